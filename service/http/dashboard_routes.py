"""The live view's routes: `GET /dashboard` (a static page from `service/http/dashboard/`), its
assets, and `GET /dashboard/stream` (server-sent step records, `service/engine/step_record_hub.py`).

Access, when the server has an API key: `EventSource` cannot send an Authorization header,
and a key in the page URL would end up in browser history, logs and Referer headers. So
`/dashboard` answers 401 with a login form; posting the right key sets an HttpOnly,
SameSite=Strict cookie scoped to /dashboard that holds an HMAC of the key (not the key),
which the browser then sends with the page, its assets and the event stream. Scripts may
send `Authorization: Bearer KEY` instead. `--disable-dashboard` registers none of this.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from pathlib import Path

from aiohttp import web

from service.http.errors import APIError
from service.http.sse import event, open_event_stream
from service.http.state import STATE

DASHBOARD_DIR = Path(__file__).with_name("dashboard")
STATIC_FILES = frozenset(
    p.name for p in DASHBOARD_DIR.iterdir() if p.suffix in (".js", ".css", ".html")
)
_TYPES = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
COOKIE = "stepserve_dashboard"
FLUSH_INTERVAL_S = 0.05  # a viewer gets at most 20 writes a second, however fast steps are
KEEPALIVE_S = 15.0


def add_dashboard(app: web.Application) -> None:
    """Register the dashboard's routes, and end its streams when the server shuts down."""
    app.add_routes([
        *page_routes(),
        web.post("/dashboard/login", login),
        web.get("/dashboard/stream", stream),
    ])
    app.on_shutdown.append(_close_streams)


def page_routes() -> list[web.RouteDef]:
    """The page and its assets (also served by `stepserve view`, which has no key)."""
    return [web.get("/dashboard", page), web.get("/dashboard/static/{name}", static_file)]


def cookie_token(key: str) -> str:
    """What the login cookie holds: an HMAC of the key, so the browser never stores the key."""
    return hmac.new(key.encode(), b"stepserve-dashboard", hashlib.sha256).hexdigest()


def _api_key(request: web.Request) -> str | None:
    state = request.app.get(STATE)
    return state.config.api_key if state is not None else None


def authorized(request: web.Request) -> bool:
    """True without an API key, or with the login cookie or a Bearer header."""
    key = _api_key(request)
    if not key:
        return True
    cookie = request.cookies.get(COOKIE, "")
    if cookie and hmac.compare_digest(cookie.encode(), cookie_token(key).encode()):
        return True
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def _require(request: web.Request) -> None:
    if not authorized(request):
        raise APIError(401, "the dashboard needs the API key: log in at /dashboard, or send "
                            "'Authorization: Bearer <key>'", code="invalid_api_key")


def _login_page(status: int, message: str = "") -> web.Response:
    html = (DASHBOARD_DIR / "login.html").read_text().replace("{{message}}", message)
    return web.Response(text=html, status=status, content_type="text/html")


async def page(request: web.Request) -> web.StreamResponse:
    """GET /dashboard: the page, or (401) the login form when a key is needed."""
    if not authorized(request):
        return _login_page(401)
    return web.FileResponse(DASHBOARD_DIR / "index.html", headers={"Cache-Control": "no-cache"})


async def static_file(request: web.Request) -> web.StreamResponse:
    """GET /dashboard/static/{name}: one of the package's own files, nothing else."""
    _require(request)
    name = request.match_info["name"]
    if name not in STATIC_FILES:
        raise APIError(404, f"no dashboard file {name!r}", code="not_found")
    path = DASHBOARD_DIR / name
    return web.FileResponse(
        path, headers={"Content-Type": _TYPES[path.suffix], "Cache-Control": "no-cache"}
    )


async def login(request: web.Request) -> web.StreamResponse:
    """POST /dashboard/login (form field `key`): set the cookie and go to the dashboard."""
    key = _api_key(request)
    given = str((await request.post()).get("key", ""))
    if key and not hmac.compare_digest(given.encode(), key.encode()):
        return _login_page(401, "That key is not right.")
    redirect = web.HTTPSeeOther("/dashboard")
    if key:
        redirect.set_cookie(
            COOKIE, cookie_token(key), path="/dashboard", httponly=True, samesite="Strict"
        )
    raise redirect


async def stream(request: web.Request) -> web.StreamResponse:
    """GET /dashboard/stream: a `hello` event, then step (and gap) records as they happen."""
    _require(request)
    loaded = request.app[STATE].require_ready()
    hub = loaded.engine.step_records
    if not hub.available:
        raise APIError(503, "this engine's scheduler has no live view", code="unavailable")
    sub = hub.subscribe()
    response = web.StreamResponse()
    try:
        response = await open_event_stream(request)
        await response.write(event(hub.hello(model=loaded.model_name, source="live")))
        loop = asyncio.get_running_loop()
        while (batch := await sub.wait(KEEPALIVE_S)) is not None:
            await response.write(b"".join(batch) if batch else b": keep-alive\n\n")
            # Let records pile up: one write per flush. Every viewer flushes on the same
            # ticks, so viewers that keep up hold the same records and share one encoding.
            await asyncio.sleep(FLUSH_INTERVAL_S - loop.time() % FLUSH_INTERVAL_S)
    except ConnectionError:
        pass  # the viewer left; nothing to clean up but the subscription
    finally:
        hub.unsubscribe(sub)
    return response


async def _close_streams(app: web.Application) -> None:
    loaded = app[STATE].loaded
    if loaded is not None:
        loaded.engine.step_records.close()
