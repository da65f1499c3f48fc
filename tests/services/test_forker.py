"""The forker (lamina.services.launch.forker): services forked from one process that
imported their modules once, with what a fresh interpreter's service would have had (its
log, exit code, session, name), and nothing left when the forker goes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lamina.lifetime import child_env
from lamina.services.launch.forker import Close, Exited, Forker, ForkerGone, Ready, Spawn, Spawned, decode, encode


@pytest.fixture
def long_running(tmp_path) -> list[str]:
    """A service that runs until it is stopped and reaches no network: a scheduler waiting
    for its metadata store at a Unix socket that nothing serves."""
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(f"redis_url: unix://{tmp_path}/no-redis.sock\n")
    return ["scheduler", "--config", str(cfg)]


def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


@pytest.fixture
def forker(tmp_path):
    f = Forker(child_env(), tmp_path / "forker.log", preload=("json",))
    yield f
    f.close()


def _ppid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def test_a_forked_command_writes_its_log_and_exits_as_a_fresh_one_does(forker, tmp_path):
    args = ["status", "--port", "1"]  # no stack there: a message and exit code 1
    fresh = subprocess.run([sys.executable, "-P", "-m", "lamina.cli", *args], capture_output=True, text=True,
                           env=child_env())
    log = tmp_path / "status.log"
    proc = forker.spawn("status", args, log)
    assert proc.wait(timeout=60) == fresh.returncode == 1
    assert log.read_text() == fresh.stdout + fresh.stderr
    assert "no cluster found" in log.read_text()
    again = forker.spawn("status", args, log, note="restart 1 of status")
    assert again.pid != proc.pid and again.wait(timeout=60) == 1
    assert log.read_text().count("no cluster found") == 2 and "--- lamina: restart 1 of status ---" in log.read_text()
    assert "preloaded 1 modules" in (tmp_path / "forker.log").read_text()


def test_a_forked_service_has_its_own_session_names_and_is_the_forkers_child(forker, tmp_path, long_running):
    proc = forker.spawn("model-7", long_running, tmp_path / "model-7.log")
    try:
        _until(lambda: Path(f"/proc/{proc.pid}/comm").read_text().strip() == "model-7")
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        assert cmdline == " ".join(["lamina", *long_running])
        _until(lambda: "cannot reach Redis" in (tmp_path / "model-7.log").read_text())
        assert os.getsid(proc.pid) == proc.pid  # a Ctrl-C at the launcher's terminal does not reach it
        assert _ppid(proc.pid) == forker.proc.pid
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
    finally:
        proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
    proc.kill()  # reaped: no signal goes anywhere
    stopped = forker.spawn("model-8", long_running, tmp_path / "model-8.log")
    _until(lambda: "cannot reach Redis" in (tmp_path / "model-8.log").read_text())
    stopped.terminate()  # SIGTERM, as Popen.terminate: the service stops as it does when asked
    fresh = subprocess.Popen([sys.executable, "-P", "-m", "lamina.cli", *long_running], env=child_env(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert "cannot reach Redis" in fresh.stderr.readline()
        fresh.terminate()
        assert stopped.wait(timeout=60) == fresh.wait(timeout=60)
    finally:
        fresh.kill()
        fresh.wait()


def test_the_forkers_death_ends_its_services_and_says_it_is_gone(forker, tmp_path, long_running):
    proc = forker.spawn("attention-3", long_running, tmp_path / "attention-3.log")
    _until(lambda: (tmp_path / "attention-3.log").read_text() != "")  # its PR_SET_PDEATHSIG is set
    forker.proc.kill()  # SIGKILL: the forker runs no clean-up; its children get SIGTERM from the kernel
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert not Path(f"/proc/{proc.pid}").exists() or _ppid(proc.pid) != forker.proc.pid
    assert not forker.alive and forker.ever_ready
    with pytest.raises(ForkerGone, match="not running"):
        forker.spawn("attention-3", long_running, tmp_path / "attention-3.log")


def test_a_forker_that_cannot_start_is_refused_at_its_first_spawn(tmp_path):
    """An interpreter that cannot even start (no standard library where PYTHONHOME says):
    the launcher hears of it at the first spawn and starts fresh interpreters instead."""
    broken = Forker(child_env({**os.environ, "PYTHONHOME": str(tmp_path / "nowhere")}), tmp_path / "forker.log")
    try:
        with pytest.raises(ForkerGone, match="not running"):
            broken.spawn("gateway", ["status", "--port", "1"], tmp_path / "gateway.log")
        assert not broken.ever_ready
    finally:
        broken.close()


def test_children_that_exit_at_once_are_each_reported(forker, tmp_path):
    """Each exits before its parent could read much: its exit is read by the launcher's
    reader thread, perhaps before the thread that asked for it wakes."""
    procs = [forker.spawn(f"v{i}", ["--version"], tmp_path / f"v{i}.log") for i in range(12)]
    assert [p.wait(timeout=60) for p in procs] == [0] * 12
    assert all((tmp_path / f"v{i}.log").read_text().startswith("lamina ") for i in range(12))


@pytest.mark.parametrize("gone", ["sigterm", "socket-closed"])
def test_a_launcher_gone_has_the_forker_stop_its_services_and_take_the_token_out(tmp_path, gone):
    """What the forker does when its launcher dies without stopping the stack: its
    PR_SET_PDEATHSIG sends it SIGTERM, and the launcher's end of their socket closes, in
    no given order (either alone is enough): every service is stopped and reaped, and the
    cluster token leaves the configuration file the dead launcher could not clean up."""
    cfg = tmp_path / "stack.yaml"
    cfg.write_text(f"redis_url: unix://{tmp_path}/no-redis.sock\ncluster_token: s3cret-token\n")
    forker = Forker(child_env(), tmp_path / "forker.log", preload=("json",), config_path=cfg)
    try:
        procs = [forker.spawn(f"scheduler-{i}", ["scheduler", "--config", str(cfg)], tmp_path / f"s{i}.log")
                 for i in range(2)]
        _until(lambda: all("cannot reach Redis" in (tmp_path / f"s{i}.log").read_text() for i in range(2)))
        if gone == "sigterm":
            forker.proc.send_signal(signal.SIGTERM)
        else:
            # What the forker sees of the kernel closing it when the launcher dies: its end
            # ends, with no CLOSE sent.
            forker._sock.shutdown(socket.SHUT_RDWR)
        assert forker.proc.wait(timeout=60) == 0
        codes = [p.wait(timeout=60) for p in procs]
        assert all(not Path(f"/proc/{p.pid}").exists() for p in procs), codes
        assert "s3cret-token" not in cfg.read_text()
        assert cfg.read_text().startswith("# cluster_token removed when its launcher ended without stopping it")
        assert yaml.safe_load(cfg.read_text()) == {"redis_url": f"unix://{tmp_path}/no-redis.sock",
                                                   "cluster_token": None}
    finally:
        forker.close()


def test_every_message_goes_over_the_socket_as_one_line_and_comes_back_equal():
    messages = [Spawn(3, "model-0", ["model", "--index", "0"], "/tmp/l/model-0.log", "/"), Close(),
                Ready(["transformers:TokenizersBackend"], 2), Spawned(3, 4242), Spawned(4, error="fork failed: x"),
                Exited(4242, -9)]
    for message in messages:
        line = encode(message)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert decode(line[:-1]) == message
    with pytest.raises(KeyError):
        decode(b'{"kind": "Unknown"}')
