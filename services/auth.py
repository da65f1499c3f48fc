"""The cluster token on the control plane: every gRPC call between services carries it
in the `x-lamina-token` metadata entry (services/channels.py adds it), and every gRPC
server of the stack refuses a call without it or with another value (UNAUTHENTICATED).

The standard health service stays open, so probes need no secret. A service started
without a token (cluster_token unset) serves every call and says so once in its log; on
a host other than loopback it does not start at all unless `insecure` is set
(`open_service_refusal`).
The data plane checks the same token in its own handshake (transports/handshake.py).
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import grpc

from lamina.services.config import StackConfig

log = logging.getLogger(__name__)

TOKEN_METADATA_KEY = "x-lamina-token"  # gRPC metadata keys are lower case
OPEN_SERVICES = ("/grpc.health.v1.Health/",)  # method prefixes served without the token
REFUSAL = f"missing or wrong cluster token ({TOKEN_METADATA_KEY}); see cluster_token in the stack configuration"


def token_matches(presented: str | bytes | None, token: str) -> bool:
    """Whether `presented` is the token; constant time in the presented value's content."""
    if presented is None:
        return False
    if isinstance(presented, str):
        presented = presented.encode()
    return hmac.compare_digest(presented, token.encode())


def open_service_refusal(config: StackConfig, service: str) -> str | None:
    """Why `service` (any but the gateway) must not start: it would serve on a host other
    than loopback with no cluster token, so anyone who reaches the host could drive the
    stack; None when it may (a token, a loopback host, or `insecure` set)."""
    from lamina.gateway.config import is_loopback

    if config.cluster_token is not None or config.insecure or is_loopback(config.host):
        return None
    return (f"configuration: the {service} would serve on {config.host!r}, which is not loopback, without a "
            "cluster token (any host that reaches it could drive the stack): set cluster_token "
            "(LAMINA_CLUSTER_TOKEN), or insecure: true (--insecure, LAMINA_INSECURE) to serve unauthenticated")


def server_interceptors(token: str | None, service: str) -> list[grpc.aio.ServerInterceptor]:
    """What a gRPC server of the stack installs: the token check, or nothing (with one
    warning) when no token is configured."""
    if token is None:
        log.warning("%s: no cluster_token configured; its gRPC calls and data-plane connections are not "
                    "authenticated (lamina up generates one)", service)
        return []
    return [TokenInterceptor(token)]


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call outside OPEN_SERVICES whose metadata lacks the token.

    Per call, not per message: a refused call that streams requests ends without waiting
    for the first one (the refusal has the refused method's kind)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the cluster token must be a non-empty string")
        self._token = token
        self._warned = False

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                              Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                presented = value
                break
        handler = await continuation(handler_call_details)
        if token_matches(presented, self._token):
            return handler
        if not self._warned:  # an unauthenticated peer must not be able to flood the log
            log.warning("refused %s: %s (further refusals are logged at debug level)", method, REFUSAL)
            self._warned = True
        else:
            log.debug("refused %s: %s", method, REFUSAL)
        return _refusal(handler)


async def _abort(_request, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)


def _refusal(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """A handler of the same kind as `handler` (unary or streaming on each side) that
    answers UNAUTHENTICATED at once; None (unknown method: UNIMPLEMENTED) stays None."""
    if handler is None:
        return None
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(_abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(_abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(_abort)
    return grpc.unary_unary_rpc_method_handler(_abort)
