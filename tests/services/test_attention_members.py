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
    with pytest.raises(ConfigError, match="attention.max_workers"):
        load_config(env={"LAMINA_ATTENTION_MAX_WORKERS": "1"})  # below the 2 workers
    with pytest.raises(ConfigError, match="head-level"):
        load_config(env={"LAMINA_ATTENTION_MAX_WORKERS": "4", "LAMINA_PARTITION": "head"})
