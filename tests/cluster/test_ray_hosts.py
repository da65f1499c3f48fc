"""`lamina up --ray` on Ray nodes with networks of their own: the head (compute: model and
prefill workers, Redis, scheduler, gateway) on one host, two memory nodes (attention
workers) on two others, each a network namespace (netns.Hosts). Services bind 0.0.0.0 and
register their Ray node's address; outputs equal transformers'; a memory node cut off
from the others has its actors replaced on the other memory node, and the stack serves
exactly again. Redis, the scheduler and the gateway ask a resource of the head's."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fault_helpers import stream_all
from netns import Hosts

from lamina.lifetime import child_env

pytestmark = [pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="ray is not installed (the ray extra: pip install -e '.[ray]')")]

REPO = Path(__file__).resolve().parents[2]
# Redis, the scheduler and the gateway ask a resource only the head has (--ray-resource),
# so that the memory nodes hold attention workers and nothing else.
COMPUTE = {"model_worker": 1, "prefill_worker": 1, "control": 3}
CONTROL = [flag for kind in ("redis", "scheduler", "gateway") for flag in ("--ray-resource", f"{kind}=control")]
MEMORY = {"attention_worker": 2}
PORT = 8000


@pytest.fixture
def ray_hosts():
    from ray_cluster import RayCluster

    hosts = Hosts(["head", "memory-1", "memory-2"]).up()
    cluster = RayCluster()
    try:
        for name, resources in (("head", COMPUTE), ("memory-1", MEMORY), ("memory-2", MEMORY)):
            cluster.add_node(resources, launcher=hosts.argv(name, []), node_ip=hosts.address(name))
        yield hosts, cluster
    finally:
        left = cluster.stop()
        hosts.down()
    assert not left, f"processes outlived the Ray cluster: {left}"


def test_lamina_up_ray_across_hosts_replaces_a_cut_off_nodes_actors(ray_hosts, references, tmp_path):
    from test_stack_ray import _Output, _query

    hosts, cluster = ray_hosts
    key = secrets.token_urlsafe(16)
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump({"host": "0.0.0.0", "gateway": {"port": PORT, "api_key": key},
                                      "attention": {"workers": 2, "kv_capacity_bytes": 256 << 20},
                                      "pipeline": {"min_micro_batch": 1}}))
    up = subprocess.Popen(hosts.argv("head", [sys.executable, "-m", "lamina.cli", "up", "--ray", cluster.address,
                                              "--config", str(config), *CONTROL]),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=child_env(),
                          start_new_session=True)
    victim = None
    try:
        output = _Output(up)
        m, seen = output.wait_for(r"serving the OpenAI API at (\S+)/v1", 400)
        base_url = m.group(1)
        cluster.snapshot()

        def exact() -> list[str]:
            return hosts.inside("head", lambda: asyncio.run(stream_all(base_url, lambda: None, None, False, key)))

        assert exact() == references
        # Each service registered its own node's address; the attention workers are on memory nodes.
        actors = hosts.inside("head", lambda: _query(cluster.address))["actors"]
        status = json.loads(hosts.inside("head", lambda: subprocess.run(
            [sys.executable, "-m", "lamina.cli", "status", "--port", str(PORT), "--json"], capture_output=True,
            text=True, timeout=60, cwd=REPO, check=True)).stdout)
        for s in status["services"]:
            name = s["name"] if s["kind"] in ("attention", "model", "prefill") else s["kind"]
            assert s["healthy"] and actors[name]["node_ip"] in s["endpoint"], (s, actors[name])
        memory_ips = {hosts.address("memory-1"): "memory-1", hosts.address("memory-2"): "memory-2"}
        on_memory = {name: memory_ips[a["node_ip"]] for name, a in actors.items() if a["node_ip"] in memory_ips}
        assert set(on_memory) == {"attention-0", "attention-1"}, actors
        victim = on_memory["attention-0"]
        other = ({"memory-1", "memory-2"} - {victim}).pop()
        moved = [name for name, node in on_memory.items() if node == victim]

        # Cut off: Ray declares the node dead, its actors are replaced on the other memory node.
        hosts.cut(victim)
        for name in moved:
            _, after = output.wait_for(rf"{name}: its Ray actor died", 180, seen)
            output.wait_for(rf"{name} runs on node {re.escape(hosts.address(other))} ", 180, after)
        assert exact() == references
    finally:
        if victim is not None:
            hosts.heal(victim)
        if up.poll() is None:
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)  # Ray ends the actors of a driver that died
                up.wait()
        # The cut-off node's actors never ran their close (Ray lost them): the directories
        # they made there, with the stack's configuration and token, are the test's to remove.
        for name in locals().get("moved", []):
            shutil.rmtree(Path(actors[name]["log_path"]).parent, ignore_errors=True)
