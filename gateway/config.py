"""The gateway's configuration: typed, frozen, validated at construction."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # When set, every /v1/ request must carry `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    # Serve without api_key on a host that is not loopback; without it, that is refused.
    insecure: bool = False
    # Refuse new requests (429) while the backend reports this many waiting; None: no gateway limit
    # (the backend may still refuse with QueueFullError).
    max_queue: int | None = None
    # The name clients use for the model (in /v1/models and the `model` field); None: the model's own name.
    served_model_name: str | None = None
    # Tokens generated when a chat request gives no max_tokens; None: the rest of the context window.
    # Completions requests without max_tokens get the smaller of this and 16 (OpenAI's default).
    default_max_tokens: int | None = None
    # Seconds that in-flight requests get to finish after shutdown starts, before they are cut.
    shutdown_timeout: float = 5.0
    # Largest request body accepted, in bytes.
    max_request_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be None or a non-empty string")
        if self.api_key is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(f"the gateway would serve the API without a key on {self.host!r}, which is not a "
                             "loopback address: set gateway.api_key (--api-key, LAMINA_API_KEY), or "
                             "gateway.insecure: true (--insecure) to serve it to anyone who can reach it")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 or None, got {self.max_queue}")
        if self.served_model_name is not None and not self.served_model_name:
            raise ValueError("served_model_name must be None or a non-empty string")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1 or None, got {self.default_max_tokens}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")

    def model_name(self, checkpoint_name: str) -> str:
        """The name the API serves for a model whose own name is `checkpoint_name`."""
        return self.served_model_name or checkpoint_name


def is_loopback(host: str) -> bool:
    """Whether `host` reaches only this machine: localhost or a loopback IP. A name that
    must be resolved, and "" or 0.0.0.0 (every interface), are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
