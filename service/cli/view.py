"""`stepserve view FILE`: a small local server that shows a simulator timeline (written by
`stepserve simulate --timeline-json FILE`) in the dashboard, with pause / step / speed
controls. It serves the dashboard's own page and assets and the file, nothing else:

    /                          -> /dashboard?timeline=/dashboard/timeline.json
    /dashboard                 the page (the same one `stepserve serve` has)
    /dashboard/timeline.json   FILE
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from aiohttp import web

from loadgen.sim.timeline import read_timeline
from service.http.dashboard_routes import page_routes

TIMELINE_PATH = "/dashboard/timeline.json"


def create_view_app(path: Path) -> web.Application:
    """The viewer app for one timeline file (checked by the caller)."""

    async def timeline(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(
            path, headers={"Content-Type": "application/json", "Cache-Control": "no-cache"}
        )

    async def root(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound(f"/dashboard?timeline={TIMELINE_PATH}")

    app = web.Application()
    app.add_routes([*page_routes(), web.get(TIMELINE_PATH, timeline), web.get("/", root)])
    return app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stepserve view", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "file", type=Path, help="a timeline file from `stepserve simulate --timeline-json`"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="interface to listen on (default %(default)s)"
    )
    p.add_argument("--port", type=int, default=8001, help="TCP port (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `stepserve view`."""
    args = build_parser().parse_args(argv)
    try:
        data = read_timeline(args.file)
    except ValueError as exc:
        print(f"stepserve view: {exc}", file=sys.stderr)
        return 2
    names = ", ".join(str(r.get("name")) for r in data["runs"])
    print(f"stepserve view: {args.file} ({names}) at http://{args.host}:{args.port}/", flush=True)
    try:
        web.run_app(
            create_view_app(args.file.resolve()), host=args.host, port=args.port, print=None
        )
    except OSError as exc:
        print(f"stepserve view: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0
