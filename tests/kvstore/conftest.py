"""Fixtures for the KV store tests: real Redis servers (never mocks) and small KV."""

from __future__ import annotations

import shutil
import uuid

import pytest

from lamina.kvstore.redis_server import EmbeddedRedis


@pytest.fixture(scope="session")
def embedded_redis():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(scope="session")
def system_redis():
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server not installed on this machine")
    with EmbeddedRedis(executable=path) as server:
        yield server


@pytest.fixture(params=["embedded", "system"])
def redis_url(request) -> str:
    server = request.getfixturevalue(f"{request.param}_redis")
    return server.url


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:10]}"
