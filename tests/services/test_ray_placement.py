"""Which Ray resource each kind of service asks, and the check that a cluster can hold
the stack (services/launch/ray_placement.py), and what `lamina up --ray` refuses before it
starts anything: no Ray cluster needed."""

from __future__ import annotations

import os
import signal

import pytest

from lamina.services.config import AttentionSection, ModelWorkerSection, StackConfig
from lamina.services.launch.launcher import service_commands
from lamina.services.launch.ray_placement import KINDS, RayPlacement, demand, parse_placement, shortfalls


def _kinds(config: StackConfig) -> list[str]:
    return [command[0] for _, _, command in service_commands(config)] + ["redis"]


def test_defaults_put_workers_on_their_nodes_and_the_rest_anywhere():
    p = RayPlacement()
    assert p.resources("model") == {"model_worker": 1.0}
    assert p.resources("prefill") == {"prefill_worker": 1.0}
    assert p.resources("attention") == {"attention_worker": 1.0}
    assert [p.resources(k) for k in ("redis", "scheduler", "gateway")] == [{}, {}, {}]
    assert set(KINDS) == {command[0] for _, _, command in service_commands(StackConfig())} | {"redis"}


def test_flags_rename_or_drop_a_kinds_resource():
    p = parse_placement(["attention=memory_node", "gateway=ingress", "prefill="])
    assert p.resources("attention") == {"memory_node": 1.0}
    assert p.resources("gateway") == {"ingress": 1.0}
    assert p.resources("prefill") == {}
    assert p.resources("model") == {"model_worker": 1.0}  # untouched


@pytest.mark.parametrize("flag, words", [("attention", "expected KIND=NAME"), ("decoder=x", "KIND one of"),
                                         ("model=GPU", "Ray's own resources"), ("model=node:1.2.3.4", "own")])
def test_malformed_flags_are_named(flag, words):
    with pytest.raises(ValueError, match=words) as e:
        parse_placement([flag])
    assert repr(flag) in str(e.value)


def test_demand_counts_one_unit_per_actor():
    config = StackConfig(attention=AttentionSection(workers=3), model_worker=ModelWorkerSection(workers=2))
    assert demand(RayPlacement(), _kinds(config)) == {"attention_worker": 3, "model_worker": 2, "prefill_worker": 1}
    shared = parse_placement(["prefill=model_worker"])
    assert demand(shared, _kinds(config)) == {"attention_worker": 3, "model_worker": 3}


def test_shortfalls_name_each_missing_resource():
    need = demand(RayPlacement(), _kinds(StackConfig()))  # 2 attention, 1 model, 1 prefill
    assert shortfalls(need, {"attention_worker": 2, "model_worker": 1, "prefill_worker": 1, "CPU": 4}) == []
    assert shortfalls(need, {"attention_worker": 1, "model_worker": 1}) == [
        "attention_worker: the actors ask 2, the cluster's nodes declare 1",
        "prefill_worker: the actors ask 1, the cluster's nodes declare 0"]


def test_lamina_up_refuses_bad_ray_flags(capsys):
    from lamina.cli import main

    assert main(["up", "--ray-resource", "model=x"]) == 2
    assert "--ray-resource needs --ray" in capsys.readouterr().err
    assert main(["up", "--ray", "127.0.0.1:1", "--ray-resource", "model"]) == 2
    assert "expected KIND=NAME" in capsys.readouterr().err


def test_lamina_up_refuses_an_address_with_no_cluster(capsys, tmp_path, monkeypatch):
    pytest.importorskip("ray", reason="ray is not installed (the ray extra)")
    import tempfile

    from lamina.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the stack makes its directory

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:  # `lamina up` takes over SIGINT and SIGTERM before it starts
        assert main(["up", "--ray", "127.0.0.1:1"]) == 1  # a closed port: refused at once, nothing started
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert "no Ray cluster at 127.0.0.1:1" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # and its directory went with it
