"""A service whose Redis does not answer at start says so in one line, retries for
deadlines.startup_s and exits non-zero; one that comes up meanwhile is waited for."""

import os
import signal
import subprocess
import sys
import time

import pytest

from lamina.services.startup import shown_url, wait_for_store


def test_the_password_is_not_shown():
    assert shown_url("redis://:s3cret@10.0.0.2:6379/0") == "redis://:***@10.0.0.2:6379/0"
    assert shown_url("redis://user:s3cret@host/1") == "redis://user:***@host/1"
    assert shown_url("redis://127.0.0.1:1") == "redis://127.0.0.1:1"


def test_an_unreachable_store_is_reported_once_then_given_up():
    lines: list[str] = []
    t0 = time.monotonic()
    assert not wait_for_store("redis://:pw@127.0.0.1:1", 1.5, lines.append)
    assert 1.4 < time.monotonic() - t0 < 10
    assert len(lines) == 2, lines
    assert lines[0].startswith("cannot reach Redis at redis://:***@127.0.0.1:1 (ConnectionError")
    assert "retrying for up to 1.5 s" in lines[0] and "pw" not in "".join(lines)
    assert lines[1].startswith("giving up: Redis at redis://:***@127.0.0.1:1 did not answer in 1.5 s")


def test_a_store_that_answers_is_not_waited_for():
    from lamina.kvstore.redis_server import EmbeddedRedis

    lines: list[str] = []
    with EmbeddedRedis() as server:
        assert wait_for_store(server.url, 5, lines.append) and lines == []


@pytest.mark.parametrize("argv", [["scheduler"], ["gateway"], ["attention", "--index", "0"]])
def test_each_service_exits_non_zero_with_two_lines_instead_of_a_traceback(tmp_path, argv):
    f = tmp_path / "stack.yaml"
    f.write_text("redis_url: redis://127.0.0.1:1\ndeadlines: {startup_s: 1}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINA_") and k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "lamina.cli", *argv, "--config", str(f)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and "Traceback" not in out.stderr, out.stderr
    assert "cannot reach Redis at redis://127.0.0.1:1" in lines[0] and "giving up" in lines[1]


@pytest.mark.parametrize("argv", [["scheduler"], ["gateway"], ["model", "--index", "0"]])
def test_each_service_without_a_redis_says_which_settings_name_one(argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINA_") and k != "REDIS_URL"}
    out = subprocess.run([sys.executable, "-m", "lamina.cli", *argv], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.strip().splitlines() == [
        "lamina: no Redis configured: set redis_url in the configuration file, REDIS_URL or --redis-url "
        "(lamina up starts one of its own)"], out.stderr


def test_ctrl_c_while_a_service_waits_for_redis_ends_it_in_one_line_more(tmp_path):
    f = tmp_path / "stack.yaml"
    f.write_text("redis_url: redis://127.0.0.1:1\ndeadlines: {startup_s: 60}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINA_") and k != "REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "lamina.cli", "scheduler", "--config", str(f)], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()  # it is waiting once it said so
        assert "cannot reach Redis at redis://127.0.0.1:1" in first
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=30)[1]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 1 and rest.strip().splitlines() == ["lamina: interrupted while waiting for Redis"], rest
