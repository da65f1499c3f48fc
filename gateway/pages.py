"""The gateway's web pages: a chat at `/`, a live dashboard at `/dashboard`.

Plain HTML, JavaScript and CSS from `gateway/static/`, served as they are: no build
step, and nothing fetched from anywhere but this gateway (the Content-Security-Policy
says so to the browser). The chat talks to `/v1/chat/completions` like any client
(with the API key typed into the page, when one is configured); the dashboard polls
`/dashboard/status` (gateway/dashboard.py), which needs the API key too when one is
configured, since it names the cluster's hosts and endpoints.
"""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from lamina.gateway.dashboard import gateway_figures, snapshot
from lamina.gateway.state import STATE_KEY

STATIC_DIR = Path(__file__).with_name("static")
STATUS_PATH = "/dashboard/status"
_HEADERS = {
    # Scripts, styles and fetches from this origin only: the pages work offline.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", _page("chat.html"))
    app.router.add_get("/dashboard", _page("dashboard.html"))
    app.router.add_get(STATUS_PATH, dashboard_status)
    app.router.add_static("/static/", STATIC_DIR)


def _page(name: str):
    path = STATIC_DIR / name

    async def handler(request: web.Request) -> web.FileResponse:
        return web.FileResponse(path, headers={**_HEADERS, "Content-Type": "text/html; charset=utf-8"})

    return handler


async def dashboard_status(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    cluster = await state.cluster.read()
    body = snapshot(gateway_figures(state.metrics.registry, state.model_name), cluster, time.time())
    return web.json_response(body, headers={"Cache-Control": "no-store"})
