"""The embedded Redis bound beyond loopback asks for its password (kvstore/redis_server.py)."""

from __future__ import annotations

import pytest
import redis

from lamina.kvstore.redis_server import EmbeddedRedis


def test_a_password_is_required_and_carried_by_the_url():
    password = 'p "w\\ d'  # quotes, a backslash and a space survive the config file and the URL
    with EmbeddedRedis(bind="0.0.0.0", password=password) as server:
        assert server.url == f"redis://:p%20%22w%5C%20d@127.0.0.1:{server.port}"
        assert server.url_for("10.0.0.7") == f"redis://:p%20%22w%5C%20d@10.0.0.7:{server.port}"
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
        with redis.Redis(host="127.0.0.1", port=server.port, protocol=2) as anonymous:
            with pytest.raises(redis.AuthenticationError):
                anonymous.get("k")
        assert server.log_path.is_file() and server.pid > 0


def test_without_a_password_it_stays_on_loopback():
    with EmbeddedRedis() as server:
        assert server.url == f"redis://127.0.0.1:{server.port}"
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
