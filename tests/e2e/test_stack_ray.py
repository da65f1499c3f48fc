"""`lamina up --ray`: the stack as Ray actors on a two-node Ray cluster started here, a
compute node and a memory node told apart only by their custom resources.

Both nodes are on this host, and the services bind 0.0.0.0: each advertises its Ray
node's address, Redis asks for a password, and the gateway for an API key, as they
would across machines.
"""

from __future__ import annotations

import importlib.util
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml
from e2e_helpers import CHAT_PROMPTS, MAX_TOKENS, free_port

from lamina.lifetime import child_env

# In `make test-hosts` with the other cluster tests (about a minute of the default suite's time).
pytestmark = [pytest.mark.timeout(600), pytest.mark.hosts,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="ray is not installed (the ray extra: pip install -e '.[ray]')"),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")]

REPO = Path(__file__).resolve().parents[2]
COMPUTE = {"model_worker": 1, "prefill_worker": 1}  # the head
MEMORY = {"attention_worker": 2}
CUSTOM = ("model_worker", "prefill_worker", "attention_worker")
RESOURCE_OF = {"model-0": "model_worker", "prefill-0": "prefill_worker", "attention-0": "attention_worker",
               "attention-1": "attention_worker", "redis": None, "scheduler": None, "gateway": None}
SERVICE_IDS = {name: name for name in ("attention-0", "attention-1", "model-0", "prefill-0")}
SERVICE_IDS |= {"scheduler": "scheduler-0", "gateway": "gateway-0"}  # actor name -> id in the registry

# Asks the cluster, as a Ray driver of its own: the alive nodes' resources, what is
# free, and where each of the stack's named actors runs (Ray's runtime context, read in
# the actor); first kills the actors named in argv.
QUERY = """
import dataclasses, json, sys, ray
ray.init(address=sys.argv[1], namespace="lamina", log_to_driver=False, logging_level="ERROR")
for name in sys.argv[2:]:
    ray.kill(ray.get_actor(name))
actors = {}
for a in ray.util.list_named_actors(all_namespaces=True):
    if a["namespace"] == "lamina":
        try:
            p = ray.get(ray.get_actor(a["name"]).placement.remote())
        except (ray.exceptions.RayActorError, ValueError):
            continue  # dying (one just killed is still listed for a moment) or gone since the listing
        actors[a["name"]] = dataclasses.asdict(p) if p is not None else None
print(json.dumps({"nodes": {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]},
                  "available": ray.available_resources(), "actors": actors}))
"""


def _query(address: str, *kill: str) -> dict:
    out = subprocess.run([sys.executable, "-c", QUERY, address, *kill], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"the cluster query failed (exit {out.returncode}): {out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


class _Output:
    """The lines a process prints, read by a thread, waited for by pattern."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout_s: float, start: int = 0) -> tuple[re.Match, int]:
        """The first line from `start` on matching `pattern`, and the index after it."""
        deadline = time.monotonic() + timeout_s
        i = start
        while True:
            while i < len(self.lines):
                m = re.search(pattern, self.lines[i])
                i += 1
                if m:
                    return m, i
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line matching {pattern!r} in {timeout_s:.0f} s:\n"
                                     + "".join(self.lines[-40:])) from None
            if line is None:
                raise AssertionError(f"lamina up exited before printing {pattern!r}:\n" + "".join(self.lines[-40:]))
            self.lines.append(line)


@pytest.fixture
def ray_cluster():
    from ray_cluster import RayCluster

    cluster = RayCluster()
    try:
        cluster.add_node(COMPUTE)
        cluster.add_node(MEMORY)
        yield cluster
    finally:
        left = cluster.stop()
    assert not left, f"processes outlived the Ray cluster: {left}"


def _chat_equals_transformers(base_url: str, api_key: str, reference_outputs) -> None:
    p = CHAT_PROMPTS[0]
    ref = reference_outputs[("chat", p)]
    with openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0) as client:
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    assert r.choices[0].model_extra["token_ids"] == ref["token_ids"]  # token for token
    assert r.choices[0].message.content == ref["text"]


def _status(port: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "lamina.cli", "status", "--port", str(port), "--json"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return {s["name"]: s for s in json.loads(out.stdout)["services"]}


def _alive(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_lamina_up_ray_places_each_kind_by_its_resource(ray_cluster, reference_outputs, tmp_path):
    port, key = free_port(), secrets.token_urlsafe(16)
    config = tmp_path / "stack.yaml"
    config.write_text(yaml.safe_dump({"host": "0.0.0.0", "gateway": {"port": port, "api_key": key},
                                      "attention": {"workers": 2, "kv_capacity_bytes": 256 << 20},
                                      "pipeline": {"min_micro_batch": 1}}))
    # More attention workers than the cluster has units for: refused before any actor exists.
    too_many = subprocess.run([sys.executable, "-m", "lamina.cli", "up", "--ray", ray_cluster.address, "--config",
                               str(config), "--attention-workers", "3"], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env=child_env())
    assert too_many.returncode == 1
    assert "attention_worker: the actors ask 3, the cluster's nodes declare 2" in too_many.stderr

    up = subprocess.Popen([sys.executable, "-m", "lamina.cli", "up", "--ray", ray_cluster.address,
                           "--config", str(config)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=REPO, env=child_env(), start_new_session=True)
    try:
        output = _Output(up)
        m, _ = output.wait_for(r"serving the OpenAI API at (\S+)/v1", 300)
        base_url = m.group(1)
        ray_cluster.snapshot()  # the actors' processes and the services, for the check at the end
        _chat_equals_transformers(base_url, key, reference_outputs)

        # Each kind runs where its resource is, holding one unit of it; the others ask none.
        state = _query(ray_cluster.address)
        actors, nodes = state["actors"], state["nodes"]
        assert set(actors) == set(RESOURCE_OF)  # and none left by the refused start
        (compute,) = [n for n, r in nodes.items() if "model_worker" in r]
        (memory,) = [n for n, r in nodes.items() if "attention_worker" in r]
        for name, resource in RESOURCE_OF.items():
            if resource is None:
                assert actors[name]["resources"] == {}, name
            else:
                assert actors[name]["resources"] == {resource: 1.0}, name
                assert actors[name]["node_id"] == (memory if resource == "attention_worker" else compute), name
        assert all(state["available"].get(r, 0) == 0 for r in CUSTOM)  # every unit is held
        # Bound on 0.0.0.0, each service registered its Ray node's address.
        status = _status(port)
        for name, service_id in SERVICE_IDS.items():
            actor, service = actors[name], status[service_id]
            assert service["healthy"] and service["pid"] == actor["pid"], service
            assert actor["node_ip"] in service["endpoint"], service

        # A killed actor is reported and replaced: Ray places the new one by its resource.
        _, after = output.wait_for(r"prefill-0 runs on node", 1)
        _query(ray_cluster.address, "prefill-0")
        _, after = output.wait_for(r"prefill-0: its Ray actor died: .*killed by `ray.kill`", 60, after)
        m, _ = output.wait_for(r"prefill-0 runs on node .* with \{'prefill_worker': 1.0\}: pid (\d+)", 120, after)
        new_pid = int(m.group(1))
        deadline = time.monotonic() + 120
        while (s := _status(port)["prefill-0"])["pid"] != new_pid or not s["healthy"]:
            assert time.monotonic() < deadline, f"the new prefill-0 did not register: {s}"
            time.sleep(1)  # polling the registry: there is no event to wait on
        assert s["restarts"] == 1
        shutil.rmtree(Path(actors["prefill-0"]["log_path"]).parent)  # what the killed actor left on its node
        ray_cluster.snapshot()
        _chat_equals_transformers(base_url, key, reference_outputs)

        # SIGTERM stops every service and ends every actor: the resources are free again.
        pids = [a["pid"] for name, a in actors.items() if name != "prefill-0"] + [new_pid]
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, "".join(output.lines[-40:])
        state = _query(ray_cluster.address)
        assert state["actors"] == {}
        assert all(state["available"].get(r) == nodes[compute].get(r, 0) + nodes[memory].get(r, 0) for r in CUSTOM)
        assert not [p for p in pids if _alive(p)], "service processes outlived lamina up"
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)  # Ray ends the actors of a driver that died
            up.wait()
