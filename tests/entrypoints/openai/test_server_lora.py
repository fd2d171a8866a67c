"""Multi-LoRA through the server, vLLM's interface: ``--lora-modules``, ``model`` naming an
adapter, /v1/models, POST /v1/load_lora_adapter and /v1/unload_lora_adapter, the LoRA metrics.

One server over the tiny llama (engine core in its own process, as under ``memwall serve``)
starts with two adapters; greedy outputs must equal an offline ``LLM(enable_lora=True)`` run with
the same adapter, and every bad load is a 400 or 404 after which the server stays healthy.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import threading
from itertools import count
from types import SimpleNamespace

import httpx
import pytest
from openapi_spec import (CHAT_COMPLETION, CHAT_COMPLETION_CHUNK, COMPLETION, COMPLETION_CHUNK,
                          ERROR, MODEL, MODEL_LIST, check_sse_chunks, validate)

from memwall import SamplingParams
from memwall.lora import LoRARequest
from tests.entrypoints.openai.conftest import ENGINE_ARGS
from tests.lora.conftest import make_peft_adapter

pytestmark = pytest.mark.slow

LORA_ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=4)
PROMPT = "Once upon a time"
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # several KV blocks of 16
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
MAX_TOKENS = 12
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict:
    """Adapters of the tiny llama made with peft, and broken ones for the 400s."""
    root = tmp_path_factory.mktemp("server-lora")
    made = {
        "all8": make_peft_adapter(model_dir, root / "all8", seed=1, r=8),
        "qv4": make_peft_adapter(model_dir, root / "qv4", seed=2, r=4, alpha=8,
                                 targets=["q_proj", "v_proj"]),
        "mlp16": make_peft_adapter(model_dir, root / "mlp16", seed=3, r=16,
                                   targets=["gate_proj", "up_proj", "down_proj"]),
        "rs2": make_peft_adapter(model_dir, root / "rs2", seed=4, r=2, alpha=4, rslora=True),
        "rank32": make_peft_adapter(model_dir, root / "rank32", seed=5, r=32, alpha=32,
                                    targets=["q_proj", "v_proj"]),
    }
    made["no_lora_b"] = _without_lora_b(made["all8"], root / "no_lora_b")
    made["hidden32"] = make_peft_adapter(_hidden32_model(root / "base32"), root / "hidden32",
                                         seed=6, r=4)
    return made


def _without_lora_b(source, target):
    """A copy of a PEFT adapter whose safetensors holds the lora_A tensors only."""
    from safetensors.torch import load_file, save_file

    target.mkdir()
    shutil.copy(source / "adapter_config.json", target / "adapter_config.json")
    tensors = load_file(source / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "lora_A" in k}, target / "adapter_model.safetensors")
    return target


def _hidden32_model(directory):
    """A llama like the tiny one but with hidden size 32: its adapters do not fit the server's."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def lora_server(model_dir, adapters, start_server):
    from memwall.entrypoints.openai.serving_lora import LoRAModulePath

    live = start_server(model_dir, served_model_names=["tiny"], core_process=True,
                        lora_modules=[LoRAModulePath("all8", str(adapters["all8"])),
                                      LoRAModulePath("qv4", str(adapters["qv4"]))],
                        **LORA_ARGS)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def oracle(model_dir):
    """Greedy outputs of an offline LLM with the same engine settings: oracle(prompt or
    messages, adapter path or None, max_tokens) -> text."""
    from memwall import LLM

    llm = LLM(str(model_dir), **ENGINE_ARGS, **LORA_ARGS)
    ids = count(1)

    def run(prompt, path=None, max_tokens: int = MAX_TOKENS) -> str:
        lora = None if path is None else LoRARequest(f"offline-{path.name}", next(ids), str(path))
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if isinstance(prompt, list):
            out = llm.chat(prompt, params, lora_request=lora)[0]
        else:
            out = llm.generate(prompt, params, lora_request=lora)[0]
        return llm.tokenizer.decode(out.outputs[0].token_ids)

    return run


# ---- helpers -----------------------------------------------------------------------------------
def complete(server, model: str, prompt: str = PROMPT, stream: bool = False, **extra) -> str:
    """The completion's text (checked against the spec; its ``model`` echoes the one asked for)."""
    body = {"model": model, "prompt": prompt, **GREEDY, **extra, "stream": stream}
    with server.client() as http:
        response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = check_sse_chunks(response.text, COMPLETION_CHUNK)
        assert {e["model"] for e in events} == {model}
        return "".join(c["text"] for e in events for c in e["choices"])
    payload = response.json()
    validate(COMPLETION, payload)
    assert payload["model"] == model
    return payload["choices"][0]["text"]


def chat(server, model: str, stream: bool = False) -> str:
    body = {"model": model, "messages": MESSAGES, **GREEDY, "stream": stream}
    with server.client() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = check_sse_chunks(response.text, CHAT_COMPLETION_CHUNK)
        assert {e["model"] for e in events} == {model}
        return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    payload = response.json()
    validate(CHAT_COMPLETION, payload)
    assert payload["model"] == model
    return payload["choices"][0]["message"]["content"]


def load(server, name: str, path) -> httpx.Response:
    with server.client() as http:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def unload(server, name: str) -> httpx.Response:
    with server.client() as http:
        return http.post("/v1/unload_lora_adapter", json={"lora_name": name})


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    payload = response.json()
    validate(ERROR, payload)
    return payload["error"]


def model_ids(server) -> list[str]:
    with server.client() as http:
        return [m["id"] for m in http.get("/v1/models").json()["data"]]


def assert_healthy(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


# ---- serving adapters --------------------------------------------------------------------------
def test_models_lists_the_base_and_each_adapter(lora_server, adapters):
    with lora_server.client() as http:
        body = http.get("/v1/models").json()
    validate(MODEL_LIST, body)
    for card in body["data"]:
        validate(MODEL, card)
    cards = {card["id"]: card for card in body["data"]}
    assert list(cards) == ["tiny", "all8", "qv4"]
    assert cards["tiny"]["parent"] is None
    for name in ("all8", "qv4"):
        assert cards[name]["root"] == str(adapters[name]) and cards[name]["parent"] == "tiny"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("model", ["tiny", "all8", "qv4"])
def test_completion_and_chat_equal_offline(lora_server, adapters, oracle, model, stream):
    path = None if model == "tiny" else adapters[model]
    assert complete(lora_server, model, stream=stream) == oracle(PROMPT, path)
    assert chat(lora_server, model, stream=stream) == oracle(MESSAGES, path)


def test_adapters_change_the_output(lora_server, adapters, oracle):
    base = complete(lora_server, "tiny")
    assert base == oracle(PROMPT)
    assert {complete(lora_server, "all8"), complete(lora_server, "qv4")} - {base}


def test_requests_with_base_and_adapters_at_once(lora_server, adapters, oracle):
    """A batch mixing the base model and both adapters gives each what it gets alone."""
    models = ["tiny", "all8", "qv4", "all8", "tiny", "qv4"]
    results: dict[int, str] = {}

    def one(i: int, model: str) -> None:
        results[i] = complete(lora_server, model, prompt=f"{PROMPT} {i}")

    threads = [threading.Thread(target=one, args=(i, m)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, model in enumerate(models):
        path = None if model == "tiny" else adapters[model]
        assert results[i] == oracle(f"{PROMPT} {i}", path), model


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(lora_server, path):
    body = {"model": "no-such-adapter", "prompt": PROMPT, "messages": MESSAGES, "max_tokens": 2}
    with lora_server.client() as http:
        error = error_of(http.post(path, json=body), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'no-such-adapter'" in error["message"] and "'all8'" in error["message"]
    assert_healthy(lora_server)


# ---- loading and unloading at run time ---------------------------------------------------------
def test_load_use_unload(lora_server, adapters, oracle):
    response = load(lora_server, "mlp", adapters["mlp16"])
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'mlp' added successfully."
    assert "mlp" in model_ids(lora_server)
    assert complete(lora_server, "mlp") == oracle(PROMPT, adapters["mlp16"])
    assert chat(lora_server, "mlp", stream=True) == oracle(MESSAGES, adapters["mlp16"])

    response = unload(lora_server, "mlp")
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'mlp' removed successfully."
    assert "mlp" not in model_ids(lora_server)
    with lora_server.client() as http:
        gone = http.post("/v1/completions", json={"model": "mlp", "prompt": PROMPT, **GREEDY})
    assert error_of(gone, 404)["code"] == "model_not_found"
    error = error_of(unload(lora_server, "mlp"), 404)  # a second unload: nothing to unload
    assert error["code"] == "lora_not_found" and "'mlp'" in error["message"]
    assert_healthy(lora_server)


def test_unload_unknown_is_404(lora_server):
    error = error_of(unload(lora_server, "never-loaded"), 404)
    assert error["param"] == "lora_name" and "'never-loaded'" in error["message"]
    assert_healthy(lora_server)


@pytest.mark.parametrize("name,adapter,expected", [
    ("big", "rank32", ["rank 32", "--max-lora-rank 16"]),
    ("half", "no_lora_b", ["no lora_B tensor"]),
    ("narrow", "hidden32", ["has lora_A [4, ", "this model needs [r, "]),
    ("nowhere", None, ["does not exist"]),
    ("all8", "qv4", ["already loaded"]),
    ("tiny", "qv4", ["base model"]),
], ids=["rank-above-max", "missing-lora-b", "wrong-shapes", "bad-path", "name-taken", "base-name"])
def test_bad_load_is_400_with_the_reason(lora_server, adapters, tmp_path, name, adapter, expected):
    path = adapters[adapter] if adapter else tmp_path / "missing"
    before = model_ids(lora_server)
    error = error_of(load(lora_server, name, path), 400)
    for text in expected:
        assert text in error["message"], error
    assert error["param"] in ("lora_name", "lora_path")
    assert model_ids(lora_server) == before  # nothing half-registered
    assert_healthy(lora_server)
    if name not in before:
        with lora_server.client() as http:
            response = http.post("/v1/completions", json={"model": name, "prompt": PROMPT})
        error_of(response, 404)


@pytest.mark.parametrize("path,body", [
    ("/v1/load_lora_adapter", {"lora_name": "x"}),
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/tmp"}),
    ("/v1/unload_lora_adapter", {}),
], ids=["load-no-path", "load-empty-name", "unload-no-name"])
def test_malformed_adapter_bodies_are_400(lora_server, path, body):
    with lora_server.client() as http:
        error_of(http.post(path, json=body), 400)
    assert_healthy(lora_server)


def test_load_and_unload_while_a_request_streams(lora_server, adapters, oracle):
    """A long stream through one adapter runs on while another is loaded, used and unloaded;
    it completes normally, with the output it has alone."""
    long_tokens = 300
    body = {"model": "all8", "prompt": PROMPT, **GREEDY, "max_tokens": long_tokens, "stream": True}
    with lora_server.client() as http, http.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        lines = stream.iter_lines()
        first = next(lines)
        assert first.startswith("data: {")
        assert load(lora_server, "live", adapters["rs2"]).status_code == 200
        assert complete(lora_server, "live") == oracle(PROMPT, adapters["rs2"])
        assert unload(lora_server, "live").status_code == 200
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in [first, *rest[:-1]]]
    for event in events:
        validate(COMPLETION_CHUNK, event)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    streamed = "".join(c["text"] for e in events for c in e["choices"])
    assert streamed == oracle(PROMPT, adapters["all8"], max_tokens=long_tokens)
    assert_healthy(lora_server)


def test_reload_under_the_same_name_serves_the_new_weights(lora_server, model_dir, oracle,
                                                           tmp_path):
    """Unload, new weights at the same path, load under the same name: the same prompt (KV
    blocks cached from the old weights, prefix caching on) gives the new adapter's output."""
    path = make_peft_adapter(model_dir, tmp_path / "hot", seed=11, r=8)
    old = oracle(LONG_PROMPT, path)
    assert load(lora_server, "hot", path).status_code == 200
    assert complete(lora_server, "hot", prompt=LONG_PROMPT) == old
    lora_server.wait_idle()
    hits = lora_server.metric("memwall:prefix_cache_hits_total")
    assert complete(lora_server, "hot", prompt=LONG_PROMPT) == old
    lora_server.wait_idle()
    assert lora_server.metric("memwall:prefix_cache_hits_total") > hits  # the prompt is cached

    assert unload(lora_server, "hot").status_code == 200
    shutil.rmtree(path)
    make_peft_adapter(model_dir, path, seed=12, r=8)
    new = oracle(LONG_PROMPT, path)
    assert new != old
    assert load(lora_server, "hot", path).status_code == 200
    hits = lora_server.metric("memwall:prefix_cache_hits_total")
    assert complete(lora_server, "hot", prompt=LONG_PROMPT) == new
    lora_server.wait_idle()
    assert lora_server.metric("memwall:prefix_cache_hits_total") == hits  # none of the old KV
    assert unload(lora_server, "hot").status_code == 200
    assert_healthy(lora_server)


# ---- metrics -----------------------------------------------------------------------------------
def test_lora_metrics_are_scraped(lora_server):
    complete(lora_server, "all8")
    lora_server.wait_idle()
    text = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    stats = lora_server.engine.stats.lora
    if stats is None:  # the engine core does not report LoRA counters (yet): none exported
        assert "memwall:lora_" not in text
        return
    assert lora_server.metric("memwall:lora_adapter_loads_total") == stats.loads >= 1
    assert lora_server.metric("memwall:lora_adapters_resident") == stats.resident >= 1
    assert lora_server.metric("memwall:lora_requests_total", 'adapter="all8"') >= 1
    assert 'memwall:lora_prefix_cache_hit_rate{adapter="all8"}' in text
    assert "memwall:lora_adapter_evictions_total" in text
    assert "memwall:lora_cached_blocks_not_resident_ratio" in text


def test_lora_metrics_from_a_snapshot():
    from prometheus_client import CollectorRegistry, generate_latest

    from memwall.engine.protocol import AdapterCounters, EngineStats, LoRAStatsSnapshot
    from memwall.entrypoints.openai.metrics import EngineCollector

    lora = LoRAStatsSnapshot(loads=5, evictions=2, resident=3, cached_blocks=8,
                             cached_blocks_not_resident=2, adapters=(
                                 AdapterCounters("a", requests=4, loads=2, prefix_queries=100,
                                                 prefix_hits=25),
                                 AdapterCounters("b", requests=1, loads=3)))
    engine = SimpleNamespace(stats=EngineStats(lora=lora), num_waiting=0)
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    lines = set(generate_latest(registry).decode().splitlines())
    for line in ["memwall:lora_adapter_loads_total 5.0", "memwall:lora_adapter_evictions_total 2.0",
                 "memwall:lora_adapters_resident 3.0",
                 "memwall:lora_cached_blocks_not_resident_ratio 0.25",
                 'memwall:lora_requests_total{adapter="a"} 4.0',
                 'memwall:lora_requests_total{adapter="b"} 1.0',
                 'memwall:lora_prefix_cache_hit_rate{adapter="a"} 0.25',
                 'memwall:lora_prefix_cache_hit_rate{adapter="b"} 0.0']:
        assert line in lines, line
    engine.stats = EngineStats()  # LoRA off: no LoRA series at all
    assert "memwall:lora_" not in generate_latest(registry).decode()


# ---- without --enable-lora ---------------------------------------------------------------------
def test_adapter_routes_without_lora_are_400(server, adapters):
    """The shared server (API key, no --enable-lora)."""
    for path, body in [("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["qv4"])}),
                       ("/v1/unload_lora_adapter", {"lora_name": "x"})]:
        with server.client() as http:
            error = error_of(http.post(path, json=body), 400)
        assert error["message"] == "LoRA is not enabled (--enable-lora)"
        error_of(httpx.post(f"{server.url}{path}", json=body, timeout=10), 401)  # needs the key
    assert_healthy(server)


# ---- the API side's registry and the engine thread (no model) ----------------------------------
def test_unload_reaches_the_engine_thread_and_reloads_get_new_ids(adapters, model_dir):
    """Each load gets a fresh id; an unload hands the id to the engine on its own thread."""
    from test_server_async_engine import FakeEngine

    from memwall.config import ModelArchConfig
    from memwall.engine.async_engine import AsyncLLMEngine
    from memwall.engine.protocol import EngineCoreInfo
    from memwall.entrypoints.openai.errors import APIError
    from memwall.entrypoints.openai.serving_lora import OpenAIServingModels

    arch = ModelArchConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))

    class LoRAFake(FakeEngine):
        def __init__(self) -> None:
            super().__init__()
            self.removed: list[tuple[int, int]] = []
            info = EngineCoreInfo("fake", 64, 10, 4, "", arch=arch, max_lora_rank=16)
            self.core = SimpleNamespace(info=info, has_unfinished_requests=lambda: False)

        def remove_lora(self, lora_int_id: int) -> None:
            self.removed.append((lora_int_id, threading.get_ident()))

    fake = LoRAFake()
    engine = AsyncLLMEngine(fake)
    engine.start()
    models = OpenAIServingModels(engine, ["fake"])

    async def main():
        first = await models.load("x", str(adapters["qv4"]))
        assert models.resolve("x") == ("x", first)
        with pytest.raises(APIError) as taken:
            await models.load("x", str(adapters["all8"]))
        assert taken.value.status == 400
        assert models.unload("x") == first
        with pytest.raises(APIError) as gone:
            models.resolve("x")
        assert gone.value.status == 404
        second = await models.load("x", str(adapters["all8"]))
        assert second.lora_int_id > first.lora_int_id
        await engine.shutdown()
        return first

    first = asyncio.run(main())
    assert engine.dead_error is None
    assert [lora_id for lora_id, _ in fake.removed] == [first.lora_int_id]
    assert {thread for _, thread in fake.removed} == fake.threads - {threading.get_ident()}


# ---- memwall serve -----------------------------------------------------------------------------
@pytest.mark.parametrize("flags,expected", [
    (["--enable-lora", "--lora-modules", "gone=/no/such/adapter"], "does not exist"),
    (["--lora-modules", "qv4={qv4}"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--max-lora-rank", "16", "--lora-modules", '{{"name": "big", "path": "{rank32}"}}'],
     "adapter 'big' has rank 32, above --max-lora-rank 16"),
], ids=["bad-path", "lora-off", "rank-above-max"])
def test_serve_reports_a_bad_lora_module_in_one_line(model_dir, adapters, flags, expected):
    flags = [f.format(**{k: str(v) for k, v in adapters.items()}) for f in flags]
    cmd = [sys.executable, "-m", "memwall.entrypoints.cli", "serve", str(model_dir), "--port", "0",
           "--num-kv-blocks", "64", "--max-model-len", "512", "--no-show-progress", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("memwall: error: ") and expected in last, proc.stderr
