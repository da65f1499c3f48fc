"""The attention pool's membership (services/attention_members.py) and its settings."""

from __future__ import annotations

import pytest

from lamina.services.attention_members import membership, worker_index
from lamina.services.config import ConfigError, load_config


def test_worker_index_reads_the_number_after_the_last_dash():
    assert worker_index("attention-0") == 0
    assert worker_index("attention-12") == 12
    assert worker_index("attention") is None
    assert worker_index("attention-x") is None
    assert worker_index("-3") is None


def test_a_new_registration_within_the_limit_joins():
    change = membership({0: "a:1"}, [("attention-0", "a:1"), ("attention-1", "b:1")], limit=4)
    assert change.joined == {1: "b:1"} and change.left == frozenset()


def test_registrations_at_or_past_the_limit_are_ignored():
    change = membership({0: "a:1"}, [("attention-0", "a:1"), ("attention-2", "c:1"), ("attention-3", "d:1")],
                        limit=3)
    assert change.joined == {2: "c:1"}


def test_a_worker_whose_registration_ended_leaves():
    change = membership({0: "a:1", 1: "b:1"}, [("attention-0", "a:1")], limit=2)
    assert change.joined == {} and change.left == frozenset({1})


def test_a_worker_back_at_a_new_address_joins_again():
    # restarted: same index, another port; the pool must reach it there
    change = membership({0: "a:1", 1: "b:1"}, [("attention-0", "a:1"), ("attention-1", "b:2")], limit=2)
    assert change.joined == {1: "b:2"} and change.left == frozenset()


def test_a_registration_without_an_address_is_not_a_member():
    change = membership({}, [("attention-0", ""), ("attention-1", "b:1")], limit=2)
    assert change.joined == {1: "b:1"}


def test_max_workers_is_a_limit_not_below_workers_and_not_with_head_partitioning():
    assert load_config(env={}).attention.pool_limit == 2  # 0: the pool stays at attention.workers
    assert load_config(env={"LAMINA_ATTENTION_MAX_WORKERS": "8"}).attention.pool_limit == 8
    with pytest.raises(ConfigError, match=r"attention\.max_workers"):
        load_config(env={"LAMINA_ATTENTION_MAX_WORKERS": "1"})  # below the 2 workers
    with pytest.raises(ConfigError, match="head-level"):
        load_config(env={"LAMINA_ATTENTION_MAX_WORKERS": "4", "LAMINA_PARTITION": "head"})


async def test_registered_workers_are_read_by_index_not_by_position():
    """In an elastic pool the first registered need not be 0 .. workers - 1: with
    attention-0, attention-2 and attention-10 registered (limit 12), the pool's map
    keeps each under its own index (a positional list would put attention-10, which sorts
    before attention-2, at index 1, and send worker 1's frames there)."""
    import uuid

    from lamina.kvstore.metadata import MetadataConfig, MetadataStore
    from lamina.kvstore.redis_server import EmbeddedRedis
    from lamina.services.runtime import workers_by_index

    with EmbeddedRedis() as server:
        async with MetadataStore(MetadataConfig(url=server.url, namespace=f"t{uuid.uuid4().hex[:8]}")) as store:
            for w in (0, 2, 10, 12):
                await store.register_service("attention", f"attention-{w}", f"tcp://h:{w}", {"grpc": f"h:{100 + w}"})
            by_endpoint = await workers_by_index(store, "attention", 2, 12, lambda info: info.endpoint)
            by_grpc = await workers_by_index(store, "attention", 2, 12, lambda info: info.meta["grpc"])
    assert by_endpoint == {0: "tcp://h:0", 2: "tcp://h:2", 10: "tcp://h:10"}  # 12 is past the limit
    assert by_grpc == {0: "h:100", 2: "h:102", 10: "h:110"}
