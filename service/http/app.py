"""The aiohttp application: factory, routes, middlewares, and the engine's lifetime as a
`cleanup_ctx`.

Routes: the API's are declared in one place, `_routes` below (handlers for /v1 completions in
`openai_routes.py`, for /tokenize and /detokenize in `tokenize_routes.py`, for the load a
router polls, /get_load, in `router_routes.py`); the live view's
(/dashboard, its assets, login and record stream) in `dashboard_routes.py`, which
`add_dashboard` registers unless the dashboard is disabled.

The engine starts in the background so /health can answer 503 while the model loads;
the v1 routes answer 503 until it is ready. If the engine fails, /health turns 503 and
`ServiceState.fatal` is set for the server to exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Callable

import orjson
from aiohttp import web

from scheduler.fairness import tenant_report
from service.engine.metrics import CONTENT_TYPE
from service.http import openai_routes, router_routes, tokenize_routes
from service.http.dashboard_routes import add_dashboard
from service.http.errors import APIError, Handler, error_middleware
from service.http.protocol import GENERATION_DEFAULTS, NO_DEFAULTS, GenerationDefaults
from service.http.state import STATE, AppConfig, EngineFactory, ServiceState, Status
from worker.config import BUILDING_NOTE

log = logging.getLogger(__name__)


class StartupRefused(Exception):
    """Raised by an engine factory whose settings were refused (a flag the worker cannot
    honour): logged as the message alone, without a traceback."""


def create_app(
    config: AppConfig,
    engine_factory: EngineFactory,
    generation_defaults: GenerationDefaults = NO_DEFAULTS,
) -> web.Application:
    """Build the app; the engine is created by `engine_factory` once the app starts.
    `generation_defaults` fill the sampling fields a request leaves unset."""
    app = web.Application(
        client_max_size=config.max_body_size, middlewares=[error_middleware, auth_middleware]
    )
    app[STATE] = ServiceState(config)
    app[GENERATION_DEFAULTS] = generation_defaults
    app.add_routes(_routes(config))
    if config.enable_dashboard:
        add_dashboard(app)
    app.cleanup_ctx.append(_engine_ctx(engine_factory))
    app.cleanup_ctx.append(_stall_watch_ctx)
    return app


def _routes(config: AppConfig) -> list[web.RouteDef]:
    routes = [
        web.get("/health", health),
        web.get("/version", version),
        web.get("/metrics", metrics),
        web.get(router_routes.PATH, router_routes.get_load),
        web.get("/v1/models", models),
        web.post("/v1/completions", openai_routes.completions),
        web.post("/v1/chat/completions", openai_routes.chat_completions),
        web.post("/tokenize", tokenize_routes.tokenize),
        web.post("/detokenize", tokenize_routes.detokenize),
    ]
    if config.enable_debug_endpoints:
        routes.append(web.get("/debug/kv", debug_kv))
    return routes


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer auth on /v1/*, /tokenize and /detokenize when an API key is set; /health,
    /metrics and /get_load stay open."""
    key = request.app[STATE].config.api_key
    if key and (request.path.startswith("/v1/") or request.path in tokenize_routes.PATHS):
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), key.encode()
        ):
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
            )
    return await handler(request)


def _engine_ctx(factory: EngineFactory) -> Callable[[web.Application], AsyncIterator[None]]:
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        state = app[STATE]
        starter = asyncio.create_task(_start_engine(state, factory), name="stepserve-engine-start")
        yield
        starter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starter
        if state.loaded is not None:
            await state.loaded.engine.shutdown()
        state.executor.shutdown(wait=False, cancel_futures=True)

    return ctx


async def _stall_watch_ctx(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(app[STATE].stall_watch.run(), name="stepserve-stall-watch")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _start_engine(state: ServiceState, factory: EngineFactory) -> None:
    try:
        state.loaded = await factory()
    except asyncio.CancelledError:
        raise
    except StartupRefused as exc:
        log.error("engine not started: %s", exc)
        state.fail(f"start-up refused: {exc}")
        return
    except Exception as exc:
        log.exception("engine failed to start")
        state.fail(f"start-up failed: {exc}")
        return
    engine = state.loaded.engine
    engine.start()
    state.status = Status.READY
    state.ready.set()
    log.info("serving %s (max_model_len %d)", state.loaded.model_name, state.loaded.max_model_len)
    await engine.dead.wait()
    state.fail(engine.error or "the engine stopped")


async def health(request: web.Request) -> web.Response:
    """200 when serving; 503 while starting, draining or failed. Once the engine exists it
    says which forward runs ("compiled" or "eager") and whether a compiled one is being
    built to replace the eager one."""
    state = request.app[STATE]
    body: dict[str, object] = {"status": state.status.value}
    if state.loaded is not None:
        note = state.loaded.engine.forward
        body["forward"] = "compiled" if note.startswith("compiled") else "eager"
        body["compiling"] = note == BUILDING_NOTE
    if state.error:
        body["error"] = state.error
    return _json(body, 200 if state.status is Status.READY else 503)


async def version(request: web.Request) -> web.Response:
    """GET /version."""
    try:
        v = importlib.metadata.version("stepserve")
    except importlib.metadata.PackageNotFoundError:
        v = "unknown"
    return _json({"version": v})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition (empty until the engine exists)."""
    loaded = request.app[STATE].loaded
    body = (
        b""
        if loaded is None or loaded.engine.metrics is None
        else loaded.engine.metrics.exposition()
    )
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the one served model."""
    state = request.app[STATE]
    loaded = state.require_ready()
    card = {
        "id": loaded.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "stepserve",
        "root": loaded.model_path,
        "max_model_len": loaded.max_model_len,
    }
    return _json({"object": "list", "data": [card]})


async def debug_kv(request: web.Request) -> web.Response:
    """GET /debug/kv (only with --enable-debug-endpoints): block accounting right now."""
    engine = request.app[STATE].require_ready().engine
    stats = engine.scheduler.stats()
    return _json(
        {
            "num_free_blocks": stats.num_free_blocks,
            "num_gpu_blocks": stats.num_gpu_blocks,
            "kv_cache_usage": stats.kv_cache_usage,
            "num_running": stats.num_running,
            "num_waiting": stats.num_waiting,
            "num_swapped": stats.num_swapped,
            "num_unfinished_streams": engine.num_unfinished,
            "tenants": tenant_report(engine.scheduler),
        }
    )
