"""The gateway's aiohttp application: routes, middlewares, lifecycle.

Shutdown, in aiohttp's order: the listening sockets close; `on_shutdown` marks
the app draining (new requests get 503) and cancels every in-flight generation,
which aborts its backend request and ends its response with an error event (or
a 503); aiohttp then waits up to `shutdown_timeout` for handlers to return and
runs cleanup. Run the app with `handler_cancellation=True` (as `start_server`
and `run` do) so that a client that disconnects cancels its handler at once,
which aborts its backend request even while no token is being written.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from lamina.gateway import handlers, pages, responses_handler
from lamina.gateway.backend import Backend
from lamina.gateway.config import GatewayConfig
from lamina.gateway.dashboard import ClusterReader, ClusterView
from lamina.gateway.journal import RequestJournal
from lamina.gateway.metrics import GatewayMetrics
from lamina.gateway.protocol import ApiError
from lamina.gateway.state import JOURNAL_KEY, STATE_KEY, GatewayState
from lamina.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def create_app(
    config: GatewayConfig,
    backend: Backend,
    tokenizer: Tokenizer,
    model_name: str,
    context_length: int,
    *,
    journal: RequestJournal | None = None,
    vocab_size: int | None = None,
    cluster_status: ClusterReader | None = None,
) -> web.Application:
    """Build the OpenAI-compatible app in front of `backend`, with its web pages.

    `context_length`: prompt plus generated tokens the model can hold.
    `journal`: pass the one the backend reads, when it reads one (default: a new one,
    at `app[JOURNAL_KEY]`). `vocab_size`: the model's, to check prompt token ids
    (default: the tokenizer's). `cluster_status`: returns the cluster's state for the
    dashboard (`lamina status --json`'s object; default: none, and the page says so).
    """
    if context_length < 2:
        raise ValueError(f"context_length must be >= 2, got {context_length}")
    journal = RequestJournal() if journal is None else journal
    served = config.model_name(model_name)
    state = GatewayState(
        config=config,
        backend=backend,
        tokenizer=tokenizer,
        journal=journal,
        metrics=GatewayMetrics(backend, served),
        model_name=served,
        context_length=context_length,
        vocab_size=tokenizer.vocab_size if vocab_size is None else vocab_size,
        created=int(time.time()),
        cluster=ClusterView(cluster_status),
    )
    app = web.Application(
        middlewares=[_metrics_middleware, _error_middleware, _auth_middleware],
        client_max_size=config.max_request_bytes,
    )
    app[STATE_KEY] = state
    app[JOURNAL_KEY] = journal
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/responses", responses_handler.create_response)
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model}", handlers.get_model)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    pages.add_routes(app)
    app.on_shutdown.append(_drain)
    return app


async def _drain(app: web.Application) -> None:
    state = app[STATE_KEY]
    state.is_draining = True
    tasks = list(state.in_flight.values())
    if tasks:
        log.info("shutting down: ending %d in-flight requests", len(tasks))
    for task in tasks:
        task.cancel()


# --- middlewares (outermost first) --------------------------------------------


@web.middleware
async def _metrics_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except asyncio.CancelledError:
        status = 499  # the client closed the connection first (nginx's convention)
        raise
    finally:
        request.app[STATE_KEY].metrics.count_request(route, status)


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as OpenAI's error body with the matching status."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if isinstance(request.match_info.http_exception, web.HTTPNotFound):  # no route has this path
            error = _not_served(request)
            return web.json_response(error.body(), status=error.status)
        headers = {k: v for k, v in exc.headers.items() if k.lower() in ("allow", "retry-after")}
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        error = ApiError(exc.status, exc.reason, type=kind, code="request_too_large" if exc.status == 413 else None)
        return web.json_response(error.body(), status=exc.status, headers=headers)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        error = ApiError(500, "The server had an error while processing your request.", type="server_error")
        return web.json_response(error.body(), status=500)


def _not_served(request: web.Request) -> ApiError:
    """The 404 of a path no route has (/v1/embeddings, /v1/audio/..., any method): it
    names the request and what this server serves instead, read from the router so it
    stays true as routes are added."""
    served: dict[str, list[str]] = {}
    for route in request.app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if path.startswith("/v1/") and route.method not in ("HEAD", "*"):
            served.setdefault(path, []).append(route.method)
    listed = [f"{'/'.join(methods)} {path}" for path, methods in served.items()]
    serves = ", ".join(listed[:-1]) + " and " + listed[-1] if len(listed) > 1 else "".join(listed)
    return ApiError(404, f"{request.method} {request.path[:200]} is not served by this server, "
                         f"which serves {serves}.")


@web.middleware
async def _auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE_KEY].config.api_key
    # The dashboard's figures name the cluster's hosts and endpoints: as closed as the API.
    if key is not None and (request.path.startswith("/v1/") or request.path == pages.STATUS_PATH):
        given = request.headers.get("Authorization", "")
        if not given:
            raise ApiError(401, "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'.",
                           code="missing_api_key")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
    return await handler(request)


# --- running ------------------------------------------------------------------


def make_runner(app: web.Application) -> web.AppRunner:
    config = app[STATE_KEY].config
    return web.AppRunner(app, handler_cancellation=True, shutdown_timeout=config.shutdown_timeout,
                         access_log=None)


async def start_server(app: web.Application, host: str | None = None,
                       port: int | None = None) -> tuple[web.AppRunner, int]:
    """Serve `app` on host:port (default: the config's; port 0 picks a free one).

    Returns the runner (the caller owns it: `await runner.cleanup()` shuts down
    gracefully) and the port actually bound.
    """
    config = app[STATE_KEY].config
    runner = make_runner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host if host is None else host, config.port if port is None else port)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, runner.addresses[0][1]


def run(app: web.Application) -> None:
    """Serve until SIGINT/SIGTERM, then shut down gracefully (blocking)."""
    config = app[STATE_KEY].config
    web.run_app(app, host=config.host, port=config.port, handler_cancellation=True,
                shutdown_timeout=config.shutdown_timeout, access_log=None)
