"""`--index auto`: replicas claim distinct indexes in a real Redis, a restarted worker gets
its own back, a killed one's lapses, and the CLI serves with the claimed index."""

from __future__ import annotations

import argparse
import time
import uuid

import pytest

from lamina.commands import attention
from lamina.commands._service_args import _serve_with_claimed_index, index_limit
from lamina.kvstore.redis_server import EmbeddedRedis
from lamina.services.attention.index_claims import IndexClaim, choose_index
from lamina.services.config import load_config


def test_choose_index_prefers_the_owners_own_then_the_lowest_free():
    assert choose_index([None, None], "a:1") == 0
    assert choose_index(["b:1", None, None], "a:1") == 1
    assert choose_index([None, "a:1"], "a:1") == 1  # a restart takes its own, not a lower free one
    assert choose_index(["b:1", "c:1"], "a:1") is None


@pytest.fixture(scope="module")
def redis_url():
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def namespace() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def _claim(redis_url, namespace, owner, count=2, ttl_s=15.0) -> IndexClaim:
    return IndexClaim(redis_url, namespace, "attention", count, owner=owner, ttl_s=ttl_s)


def _holders(redis_url, namespace, count=2) -> list[str | None]:
    reader = _claim(redis_url, namespace, "reader:1", count)
    try:
        return reader.holders()
    finally:
        reader.release()


def test_replicas_claim_distinct_indexes_and_a_restart_gets_its_own_back(redis_url, namespace):
    a, b = _claim(redis_url, namespace, "host-a:1"), _claim(redis_url, namespace, "host-b:1")
    assert (a.acquire(wait_s=1), b.acquire(wait_s=1)) == (0, 1)
    try:
        third = _claim(redis_url, namespace, "host-c:1")
        with pytest.raises(TimeoutError, match=r"every attention index 0\.\.1 is held .*raise attention.workers"):
            third.acquire(wait_s=1.5)
        third.release()
        # host-b's process dies and its container restarts it (same host name and pid):
        # it claims index 1 again at once, though its claim has not lapsed.
        b._stop.set()
        b._thread.join()
        again = _claim(redis_url, namespace, "host-b:1")
        assert again.acquire(wait_s=1) == 1
        again.release()
    finally:
        a.release()
    assert _holders(redis_url, namespace) == [None, None]  # released claims are deleted


def test_a_killed_workers_claim_lapses_and_the_renewal_keeps_a_live_one(redis_url, namespace):
    live = _claim(redis_url, namespace, "host-a:1", ttl_s=1.5)
    dead = _claim(redis_url, namespace, "host-b:1", ttl_s=1.5)
    assert (live.acquire(wait_s=1), dead.acquire(wait_s=1)) == (0, 1)
    dead._stop.set()  # killed: no renewal, no release
    dead._thread.join()
    replacement = _claim(redis_url, namespace, "host-c:1", ttl_s=1.5)
    start = time.monotonic()
    assert replacement.acquire(wait_s=10) == 1  # the dead one's index, once it lapsed
    assert 0.5 < time.monotonic() - start < 5
    assert live.holders() == ["host-a:1", "host-c:1"]  # renewed past its TTL
    live.release()
    replacement.release()


def test_a_claim_lost_with_redis_is_taken_again(redis_url, namespace):
    claim = _claim(redis_url, namespace, "host-a:1", ttl_s=1.5)
    assert claim.acquire(wait_s=1) == 0
    claim._redis.delete(claim._keys[0])  # as a Redis restarted empty would
    deadline = time.monotonic() + 5
    while claim.holders()[0] is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert claim.holders()[0] == "host-a:1"
    claim.release()


def test_the_cli_accepts_auto_and_serves_with_the_claimed_index(redis_url, namespace):
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    assert parser.parse_args(["--index", "auto"]).index == "auto"
    assert parser.parse_args(["--index", "1"]).index == 1
    with pytest.raises(SystemExit):
        parser.parse_args(["--index", "first"])
    config = load_config(env={"REDIS_URL": redis_url, "LAMINA_NAMESPACE": namespace, "LAMINA_ATTENTION_WORKERS": "3"})
    assert config.attention.workers == 3
    other = _claim(redis_url, namespace, "elsewhere:1", count=3)
    assert other.acquire(wait_s=1) == 0
    served = []
    try:
        assert _serve_with_claimed_index(config, "attention", 3, "attention.workers", served.append) == 0
    finally:
        other.release()
    assert served == [1]
    assert _holders(redis_url, namespace, 3) == [None, None, None]  # the served worker released its claim on return


def test_max_workers_raises_the_indexes_a_replica_may_claim(redis_url, namespace):
    """With attention.max_workers above attention.workers a replica past the stack's
    starting count claims the next index (it joins the running pool); past
    max_workers it is refused, naming the setting to raise."""
    config = load_config(env={"LAMINA_ATTENTION_WORKERS": "1", "LAMINA_ATTENTION_MAX_WORKERS": "2"})
    assert index_limit(config, "attention") == (2, "attention.max_workers")
    assert index_limit(config, "prefill") == (1, "prefill.workers")
    assert index_limit(load_config(env={}), "attention") == (2, "attention.workers")
    claims = [IndexClaim(redis_url, namespace, "attention", 2, owner=f"elsewhere:{i}", ttl_s=3,
                         limit_setting="attention.max_workers") for i in range(3)]
    try:
        assert [c.acquire(wait_s=1) for c in claims[:2]] == [0, 1]
        with pytest.raises(TimeoutError, match=r"raise attention\.max_workers"):
            claims[2].acquire(wait_s=0.5)
    finally:
        for c in claims[:2]:
            c.release()
