"""What one gateway app holds, and the typed keys it is stored under."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from lamina.gateway.backend import Backend
from lamina.gateway.config import GatewayConfig
from lamina.gateway.dashboard import ClusterView
from lamina.gateway.journal import RequestJournal
from lamina.gateway.metrics import GatewayMetrics
from lamina.model.tokenizer import Tokenizer


@dataclass
class GatewayState:
    """Per-app state; created by `create_app`, read by handlers through `STATE_KEY`.

    `in_flight` maps each generating request's id to its handler task; handlers
    add and remove themselves, and shutdown cancels what is left. It is touched
    only from the event loop.
    """

    config: GatewayConfig
    backend: Backend
    tokenizer: Tokenizer
    journal: RequestJournal
    metrics: GatewayMetrics
    model_name: str  # the name served to clients
    context_length: int
    vocab_size: int
    created: int  # unix time the app was built, shown as the model's `created`
    cluster: ClusterView = field(default_factory=lambda: ClusterView(None))  # what /dashboard shows of the cluster
    in_flight: dict[str, asyncio.Task] = field(default_factory=dict)
    is_draining: bool = False  # set when shutdown starts; new requests get 503


STATE_KEY = web.AppKey("lamina_gateway_state", GatewayState)
# The journal, for code that holds the app but not the state (e.g. a backend wired up later).
JOURNAL_KEY = web.AppKey("lamina_gateway_journal", RequestJournal)
