"""The FastAPI app (``build_app``) and the process around it (``serve``: socket, uvicorn, signals).

Routes:  POST /v1/completions   POST /v1/chat/completions   GET /v1/models
         POST /v1/load_lora_adapter   POST /v1/unload_lora_adapter   (--enable-lora; else 400)
         GET /health  GET /metrics  GET /version  POST /tokenize  POST /detokenize
         GET /dashboard (the live dashboard, and its /dashboard/... data: entrypoints/openai/dashboard/)
With an API key, every /v1 route needs ``Authorization: Bearer <key>`` (else 401); the
dashboard's routes take it as that header, ``?key=<key>`` or the cookie that visit sets.

A request's ``model`` is one of the base model's served names, or a LoRA adapter's name
(``--lora-modules``, or loaded at run time): entrypoints/openai/serving_lora.py.

Shutdown (SIGTERM or Ctrl-C, handled by uvicorn): stop accepting connections, let open
requests finish, then the lifespan hook drains and stops the engine thread.

``memwall serve`` runs the engine core in a process of its own (memwall/engine/core_client.py):
this process loads only the tokenizer. If the core dies, its running requests get a 500 (or an
error event mid-stream), /health is 503 until a new core process has loaded, and requests that
were still queued go on there.
"""

from __future__ import annotations

import hmac
import logging
import socket
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

import memwall
from memwall.config import EngineArgs
from memwall.engine.async_engine import AsyncLLMEngine
from memwall.entrypoints.openai.dashboard.auth import dashboard_key_ok, is_dashboard_path
from memwall.entrypoints.openai.dashboard.hub import DashboardHub
from memwall.entrypoints.openai.dashboard.routes import dashboard_routes
from memwall.entrypoints.openai.errors import APIError, install_error_handlers
from memwall.entrypoints.openai.metrics import HTTPMetricsMiddleware, ServerMetrics
from memwall.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from memwall.entrypoints.openai.serving_chat import OpenAIServingChat, ToolSettings
from memwall.entrypoints.openai.serving_completions import OpenAIServingCompletion
from memwall.entrypoints.openai.serving_engine import OpenAIServing
from memwall.entrypoints.openai.serving_lora import (LoRAModulePath, OpenAIServingModels,
                                                     parse_lora_modules)

logger = logging.getLogger("memwall.server")


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)
    """Names clients may send as "model"; empty = the engine's model name."""
    api_key: str | None = None
    """When set, /v1 routes need "Authorization: Bearer <api_key>"."""
    max_queue: int | None = None
    """At most this many requests wait for a slot; more get 429 + Retry-After. None = no limit."""
    drain_timeout: float | None = None
    """Seconds to wait for running requests at shutdown; None = as long as they take."""
    tools: ToolSettings = field(default_factory=ToolSettings)
    """--enable-auto-tool-choice and --tool-call-parser."""
    lora_modules: list[LoRAModulePath] = field(default_factory=list)
    """--lora-modules: adapters served from the start (needs an engine with LoRA enabled)."""
    served_plan: dict = field(default_factory=dict)
    """The planner's keys for the served model (path, KV format, parallel sizes): the
    dashboard's live prediction (dashboard/plan.py)."""


def build_app(engine: AsyncLLMEngine, settings: ServerSettings | None = None) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine thread and drains it at shutdown.

    Raises ValueError (LoRAError: one line, the reason) for a --lora-modules adapter this
    engine cannot serve: each is read and checked here, before the server takes a request."""
    settings = settings or ServerSettings()
    models = OpenAIServingModels(engine, settings.served_model_names or [engine.model_name])
    for module in settings.lora_modules:
        models.add_startup(module)
    metrics = ServerMetrics(engine)
    completions = OpenAIServingCompletion(engine, metrics, models, settings.max_queue)
    chat = OpenAIServingChat(engine, metrics, models, settings.max_queue, tools=settings.tools)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown(drain=True, timeout=settings.drain_timeout)

    errors = {status: {"model": ErrorResponse} for status in (400, 401, 404, 429, 500, 503)}
    app = FastAPI(title="memwall", version=memwall.__version__, lifespan=lifespan, responses=errors)
    install_error_handlers(app)
    routers = [openai_routes(completions, chat), lora_routes(models), utility_routes(chat, metrics),
               dashboard_routes(DashboardHub(engine), settings.served_plan)]
    for router in routers:
        app.include_router(router)
    if settings.api_key:
        app.add_middleware(BearerAuthMiddleware, api_key=settings.api_key)
    # Added last, so outermost: it also counts the 401s the auth middleware answers.
    known = {route.path for router in routers for route in router.routes}
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics, known_paths=known)
    app.state.metrics = metrics
    return app


def openai_routes(completions: OpenAIServingCompletion, chat: OpenAIServingChat) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post("/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create(body, raw)

    @router.post("/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create(body, raw)

    @router.get("/models")
    async def list_models() -> ModelList:
        return ModelList(data=chat.models.cards(chat.engine.max_model_len))

    return router


def lora_routes(models: OpenAIServingModels) -> APIRouter:
    """vLLM's run-time adapter routes (plain-text success bodies, as vLLM answers)."""
    router = APIRouter(prefix="/v1")

    @router.post("/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        await models.load(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @router.post("/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        models.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    return router


def utility_routes(serving: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    """Routes outside /v1 (no API key): health, metrics, version, tokenizer."""
    router = APIRouter()
    engine = serving.engine

    @router.get("/health")
    async def health() -> Response:
        reason = engine.unavailable_reason
        if reason is not None:
            raise APIError(503, reason, headers={"Retry-After": "1"})
        return JSONResponse({})

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @router.get("/version")
    async def version() -> dict:
        return {"version": memwall.__version__}

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return serving.tokenize(body)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return serving.detokenize(body)

    return router


class BearerAuthMiddleware:
    """Pure ASGI: /v1 and /dashboard routes need the API key; checked before the body is even
    read. The dashboard's also take it as ?key= or a cookie (a browser's EventSource cannot
    send a header): entrypoints/openai/dashboard/auth.py."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.api_key = api_key
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith("/v1") or is_dashboard_path(path)):
            return await self.app(scope, receive, send)
        if is_dashboard_path(path):
            if dashboard_key_ok(scope, self.api_key):
                return await self.app(scope, receive, send)
            how = "open /dashboard?key=<key>, or send the header 'Authorization: Bearer <key>'"
        else:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if hmac.compare_digest(given, self.expected):  # constant time: no timing oracle
                return await self.app(scope, receive, send)
            how = "send the header 'Authorization: Bearer <key>'"
        error = APIError(401, f"invalid or missing API key: {how}", code="invalid_api_key",
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)


# ---- running the server --------------------------------------------------------------------
def server_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket with TCP_NODELAY, handed to uvicorn.

    Nagle's algorithm would hold a small SSE event (one token) back until the previous one is
    acknowledged; accepted sockets inherit TCP_NODELAY from the listener on Linux (and asyncio
    sets it on every TCP transport too), so each token leaves at once.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def uvicorn_server(app: FastAPI, log_level: str = "info"):
    import uvicorn

    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=None, backlog=2048)
    server = uvicorn.Server(config)
    # Endless responses (the dashboard's event stream) end when it is told to exit: a graceful
    # shutdown waits for every open response, so one left open would hold it forever.
    app.state.uvicorn = server
    return server


def serve(engine: AsyncLLMEngine, settings: ServerSettings, host: str, port: int,
          app: FastAPI | None = None) -> None:
    """Runs until SIGINT/SIGTERM, then shuts down gracefully. ``app``: already built."""
    app = app if app is not None else build_app(engine, settings)
    sock = server_socket(host, port)
    logger.info("memwall serving %s on http://%s:%d", engine.model_name, host, sock.getsockname()[1])
    uvicorn_server(app).run(sockets=[sock])


def run_server(args) -> int:
    """``memwall serve`` (args from the CLI parser; engine flags are already parsed there)."""
    import os

    from memwall.engine.core_client import EngineCoreStartError
    from memwall.entrypoints.cli import engine_args_from

    if args.model_path:
        args.engine_model = args.model_path
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine_args = engine_args_from(args)
    # a bad --lora-modules entry fails here, before the model loads, where it can
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None) or [])
    if lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    for module in lora_modules:
        if not Path(module.path).exists():
            raise ValueError(f"--lora-modules {module.name}: {module.path!r} does not exist")
    try:
        engine = build_engine(engine_args, core_process=getattr(args, "core_process", True))
    except EngineCoreStartError as e:
        print(f"memwall: error: {e}", file=sys.stderr)
        return 1
    names = args.served_model_name or []
    api_key = args.api_key or os.environ.get("MEMWALL_API_KEY") or None
    parser = None if args.tool_call_parser == "auto" else args.tool_call_parser
    settings = ServerSettings(served_model_names=names, api_key=api_key, max_queue=args.max_queue,
                              tools=ToolSettings(args.enable_auto_tool_choice, parser),
                              lora_modules=lora_modules, served_plan=served_plan(engine_args))
    try:
        app = build_app(engine, settings)  # reads and checks the --lora-modules adapters
    except ValueError as e:
        engine.engine.shutdown()  # the core process too
        print(f"memwall: error: {e}", file=sys.stderr)
        return 1
    serve(engine, settings, args.host, args.port, app)
    return 0


def served_plan(args: EngineArgs) -> dict:
    """What the planner needs to predict the served model on this machine (the dashboard's
    live figure): the same file and formats the engine loads."""
    plan = {"device": "this", "kv_cache_dtype": args.kv_cache_dtype,
            "tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size}
    if args.model is not None:
        plan["model"] = str(args.model)
    return plan


def build_engine(args: EngineArgs, core_process: bool = True) -> AsyncLLMEngine:
    """The server's engine. With ``core_process`` the engine core runs in a process of its own
    (one per replica with --data-parallel-size), restarted if it dies, and this process loads
    only the tokenizer; else all runs in here."""
    from memwall.engine.llm_engine import LLMEngine

    if not core_process:
        return AsyncLLMEngine(LLMEngine.from_args(args))
    from memwall.engine.core_client import MPCoreClient
    from memwall.engine.dp_client import DPCoreClient
    from memwall.loader.model_loader import load_tokenizer

    tokenizer = load_tokenizer(args.model, args.tokenizer)
    client = DPCoreClient if args.data_parallel_size > 1 else MPCoreClient

    def start() -> LLMEngine:
        return LLMEngine(client(args), tokenizer)

    return AsyncLLMEngine(start(), restart=start)
