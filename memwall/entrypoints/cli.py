"""The ``memwall`` command: ``generate`` a completion, ``chat`` interactively, ``serve`` the
OpenAI API, or ``plan`` a deployment (memwall/planner/: no model is loaded, no torch imported).

Engine flags are derived from ``EngineArgs`` fields, plan flags from ``PlanRequest``'s;
sampling flags from ``SamplingParams``. Every user error ends in one line on stderr and exit
code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
import typing

from pathlib import Path

from memwall.config import EngineArgs
from memwall.planner.request import PlanRequest
from memwall.sampling_params import SamplingParams, StructuredOutputsParams

SAMPLING_FLAGS = {  # flag -> (type, default, help)
    "max_tokens": (int, 256, "most tokens to generate"),
    "temperature": (float, 0.0, "0 = greedy"),
    "top_p": (float, 1.0, "nucleus sampling threshold"),
    "top_k": (int, 0, "sample from the k most likely tokens (0 = off)"),
    "min_p": (float, 0.0, "drop tokens below min_p x the top probability"),
    "seed": (int, None, "per-request seed"),
    "repetition_penalty": (float, 1.0, "> 1 discourages repeats"),
    "stop": (str, None, "stop string (repeatable)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, OSError, MemoryError) as e:
        print(f"memwall: error: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memwall", description="LLM inference engine")
    sub = parser.add_subparsers(title="commands")
    gen = sub.add_parser("generate", help="complete a prompt and print the text as it comes")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.set_defaults(run=run_generate)
    chat = sub.add_parser("chat", help="talk to the model; an empty line or Ctrl-D ends")
    chat.add_argument("--system", default=None, help="system message")
    chat.set_defaults(run=run_chat)
    for p in (gen, chat):
        add_engine_flags(p)
        add_sampling_flags(p)
        add_structured_flags(p)
    add_serve_parser(sub)
    add_plan_parser(sub)
    return parser


def add_serve_parser(sub) -> None:
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                       help="GGUF file or Hugging Face directory (default: the embedded model)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer <key>' on /v1 (or set MEMWALL_API_KEY)")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="most waiting requests; more get 429 with Retry-After (default: no limit)")
    serve.add_argument("--served-model-name", action="append", default=None,
                       help="model name clients use (repeatable; default: the model's own)")
    serve.add_argument("--core-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine core in a process of its own, restarted if it dies "
                            "(default); --no-core-process runs it in the server's process")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the model decides whether to call a tool; '
                            '"required" and named functions always work, enforced by a grammar)')
    serve.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
                       help="how tool calls are read from the output: hermes (<tool_call> tags: "
                            "Hermes, Qwen2.5), llama3_json, or auto (from the chat template)")
    serve.add_argument("--lora-modules", nargs="+", action="extend", default=None,
                       metavar="NAME=PATH",
                       help="LoRA adapters to serve (needs --enable-lora): name=path, or JSON "
                            '\'{"name": ..., "path": ...}\'; a request picks one by "model". '
                            "More can be loaded at run time: POST /v1/load_lora_adapter")
    add_engine_flags(serve)
    # a server expects constrained requests: their grammar backend is built while it starts
    serve.set_defaults(run=run_serve, structured_outputs_warmup=True)


def add_plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="will a model fit on a device, how fast, how many users "
                                       "(estimates; loads no model)")
    plan.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                      help="as --model (GGUF file, Hugging Face directory or built-in name)")
    hints = typing.get_type_hints(PlanRequest)
    for name, default, help_text in PlanRequest.cli_fields():
        flag = "--" + name.replace("_", "-")
        if name == "what_if":
            plan.add_argument(flag, action="append", default=None, metavar="KEY=VALUE",
                              help=help_text)
            continue
        base = next((t for t in typing.get_args(hints[name]) if t is not type(None)), hints[name])
        plan.add_argument(flag, type=base, default=default, help=help_text, dest=f"plan_{name}",
                          metavar=name.upper())
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--plot", default=None, metavar="PNG",
                      help="also draw memory bars and throughput vs batch (needs matplotlib)")
    plan.add_argument("--calibrate", action="store_true",
                      help="with --device this: measure this machine first (bandwidth, matmul "
                           "speed) and save it for later plans")
    plan.set_defaults(run=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    import json

    from memwall.planner.document import plan_document
    from memwall.planner.plan import make_plan

    values = {name: getattr(args, f"plan_{name}", None) for name, _, _ in PlanRequest.cli_fields()}
    values["what_if"] = args.what_if
    if args.model_path and values["model"] and args.model_path != values["model"]:
        raise ValueError(f"two models given: {args.model_path!r} and --model {values['model']!r}")
    values["model"] = values["model"] or args.model_path
    request = PlanRequest.from_dict(values)
    if args.calibrate:
        _calibrate(request)
    plan = make_plan(request)
    if args.plot:
        from memwall.planner.plot import write_plot

        print(f"memwall: wrote {write_plot(plan, args.plot)}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan_document(plan), indent=2))
    else:
        from memwall.planner.table import plan_table

        print(plan_table(plan))
    return 0


def _calibrate(request: PlanRequest) -> None:
    """Measures this machine into the calibration file (memwall/planner/calibrate.py's ``run``)."""
    from memwall.planner.hardware import DEFAULT_CALIBRATION

    if not request.on_host:
        raise ValueError("--calibrate measures this machine: use it with --device this, not a "
                         "GPU name")
    from memwall.planner import calibrate

    calibrate.run(Path(request.calibration or DEFAULT_CALIBRATION).expanduser())


# Where the command line wants another default than the library: people at a terminal like
# to see the model loading, and the CPU engine sizes its steps from this machine's calibration
# when one was made (memwall/engine/sizing.py); library users opt in with calibration=PATH.
CLI_DEFAULTS = {"show_progress": True, "calibration": "auto"}
# Engine fields with no flag: --seed is the per-request sampling seed on the command line.
CLI_HIDDEN = {"seed"}


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(EngineArgs)
    for name, default, help_text in EngineArgs.cli_fields():
        if name in CLI_HIDDEN:
            continue
        default = CLI_DEFAULTS.get(name, default)
        flag = "--" + name.replace("_", "-")
        kind = hints[name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        parser.add_argument(flag, type=base, default=default, help=help_text, dest=f"engine_{name}")


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    for name, (kind, default, help_text) in SAMPLING_FLAGS.items():
        action = "append" if name == "stop" else None
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                            help=help_text, action=action)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    values = {}
    for name, default, _ in EngineArgs.cli_fields():
        if name in CLI_HIDDEN:
            continue
        values[name] = getattr(args, f"engine_{name}", getattr(args, name, default))
    return EngineArgs(**values)


def add_structured_flags(parser: argparse.ArgumentParser) -> None:
    """Constrained output, as llama.cpp's CLI offers it (--json-schema, --grammar) plus the other
    kinds of StructuredOutputsParams. A value starting with @ is read from that file."""
    group = parser.add_argument_group("structured output (at most one)")
    group.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the output is JSON matching this schema (JSON text, or @file)")
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", default=None, help="the output matches this regular expression")
    group.add_argument("--choice", action="append", default=None,
                       help="the output is one of these strings (repeat the flag for each)")
    group.add_argument("--grammar", default=None,
                       help="the output follows this Lark or GBNF grammar (text, or @file)")


def structured_from(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The structured-output flags as StructuredOutputsParams (None when none is given);
    ValueError (one line) for two kinds at once or a file that cannot be read."""
    given = {"json": _text_or_file(getattr(args, "json_schema", None)),
             "json_object": getattr(args, "json_object", False) or None,
             "regex": getattr(args, "regex", None), "choice": getattr(args, "choice", None),
             "grammar": _text_or_file(getattr(args, "grammar", None))}
    given = {k: v for k, v in given.items() if v is not None}
    return StructuredOutputsParams(**given) if given else None


def _text_or_file(value: str | None) -> str | None:
    if value is None or not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as e:
        raise ValueError(f"cannot read {value[1:]!r}: {e.strerror or e}") from None


def sampling_params_from(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(**{name: getattr(args, name) for name in SAMPLING_FLAGS},
                          structured_outputs=structured_from(args))


def _load_engine(args: argparse.Namespace):
    from memwall.engine.llm_engine import LLMEngine

    return LLMEngine.from_args(engine_args_from(args))


def stream_one(engine, prompt, params: SamplingParams, out=sys.stdout,
               metrics: list | None = None) -> tuple[int, float, float]:
    """Runs one request, writing text as it is generated. Returns (tokens, ttft_s, total_s);
    ``metrics``, when given, receives the request's final RequestMetrics."""
    request_id = f"cli-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    first = None
    tokens = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            sample = output.outputs[0]
            if first is None and sample.token_ids:
                first = time.perf_counter()
            out.write(sample.delta_text)
            out.flush()
            tokens = len(sample.token_ids)
            if metrics is not None and output.finished:
                metrics.append(output.metrics)
    end = time.perf_counter()
    return tokens, (first or end) - start, end - start


def run_generate(args: argparse.Namespace) -> int:
    engine = _load_engine(args)
    params = sampling_params_from(args)
    prompt = args.prompt
    if args.chat:
        prompt = engine.processor.render_chat([{"role": "user", "content": prompt}])
    metrics: list = []
    tokens, ttft, total = stream_one(engine, prompt, params, metrics=metrics)
    print(file=sys.stdout)
    decode_rate = (tokens - 1) / (total - ttft) if tokens > 1 and total > ttft else 0.0
    spec = ""
    if metrics and metrics[-1] is not None and metrics[-1].num_verify_steps:
        m = metrics[-1]
        spec = (f"; speculative: {m.num_accepted_tokens} of {m.num_draft_tokens} draft tokens "
                f"accepted ({m.spec_acceptance_rate:.0%}), {m.spec_mean_accepted_length:.2f} "
                "tokens a verifying step")
    print(f"memwall: {tokens} tokens in {total:.2f} s; first token {ttft * 1000:.0f} ms; "
          f"decode {decode_rate:.1f} tok/s{spec}", file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    engine = _load_engine(args)
    params = sampling_params_from(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or not line.strip():
            return 0
        messages.append({"role": "user", "content": line.strip()})
        prompt = engine.processor.render_chat(messages)
        reply = _Capture(sys.stdout)
        stream_one(engine, prompt, params, out=reply)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply.text})


def run_serve(args: argparse.Namespace) -> int:
    from memwall.entrypoints.openai.server import run_server  # FastAPI only when serving

    return run_server(args)


class _Capture:
    """Writes through to a stream and remembers what was written."""

    def __init__(self, stream) -> None:
        self.stream, self.parts = stream, []

    def write(self, text: str) -> None:
        self.parts.append(text)
        self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    @property
    def text(self) -> str:
        return "".join(self.parts)


if __name__ == "__main__":
    sys.exit(main())
