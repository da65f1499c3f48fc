"""The per-user runtime directory where `lamina up` leaves what `lamina status --port`
finds: made private, and refused when it is a link, another user's, or open to others."""

import os

import pytest

from lamina.services.launch import local_stacks
from lamina.services.launch.local_stacks import UnsafeDirectory


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path / "lamina"


def test_a_stack_is_published_found_and_withdrawn_in_a_private_directory(runtime, tmp_path):
    config = tmp_path / "stack.yaml"
    local_stacks.publish(18000, config)
    assert (runtime.stat().st_mode & 0o777) == 0o700
    assert local_stacks.find(18000) == config
    # Another stack this process ran on the same port withdraws nothing of this one's.
    local_stacks.withdraw(18000, tmp_path / "another" / "stack.yaml")
    assert local_stacks.find(18000) == config
    local_stacks.withdraw(18000, config)
    assert local_stacks.find(18000) is None


def test_a_directory_open_to_others_is_refused(runtime):
    runtime.mkdir(mode=0o755)
    runtime.chmod(0o755)
    with pytest.raises(UnsafeDirectory, match=r"has mode 0755, open to others: chmod 700"):
        local_stacks.publish(18000, runtime / "x")


def test_a_link_is_not_followed(runtime, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    runtime.symlink_to(elsewhere)
    with pytest.raises(UnsafeDirectory, match="not a directory but a link"):
        local_stacks.find(18000)
    assert not any(elsewhere.iterdir())


@pytest.mark.skipif(os.geteuid() != 0, reason="giving the directory to another user needs root")
def test_another_users_directory_is_refused(runtime):
    runtime.mkdir(mode=0o700)
    os.chown(runtime, 12345, 12345)
    with pytest.raises(UnsafeDirectory, match=r"belongs to uid 12345, not to you"):
        local_stacks.publish(18000, runtime / "x")


def test_lamina_status_says_why_in_one_line(runtime, capsys):
    from lamina.cli import main

    runtime.mkdir(mode=0o777)
    runtime.chmod(0o777)
    assert main(["status", "--port", "18000"]) == 1
    err = capsys.readouterr().err
    assert "lamina status: the runtime directory" in err and "chmod 700" in err and len(err.splitlines()) == 1


def test_kept_logs_do_not_keep_the_cluster_token(tmp_path):
    import shutil

    import yaml

    from lamina.services.config import StackConfig
    from lamina.services.launch.launcher import Stack

    stack = Stack(StackConfig(cluster_token="sekret-token"), keep_logs=True)
    try:
        cfg = stack.work_dir / "stack.yaml"
        cfg.write_text(yaml.safe_dump(stack.config.to_dict()))  # as start() writes it for the services
        stack.stop()
        text = cfg.read_text()
        assert "sekret-token" not in text and yaml.safe_load(text)["cluster_token"] is None
        assert text.startswith("# cluster_token removed when the stack stopped")
    finally:
        shutil.rmtree(stack.work_dir, ignore_errors=True)


def test_lamina_up_on_a_port_another_listener_holds_refuses_before_anything_starts(runtime, tmp_path, capsys,
                                                                                   monkeypatch):
    """A second `lamina up` on a serving stack's port: the first stack's gateway would answer
    its health checks, so it would say it serves while its own gateway kept exiting, and at
    its stop remove the first stack's file. It is refused before anything starts, the port's
    `lamina up` named and its file kept; the refused stacks leave no directory behind."""
    import socket
    import tempfile

    from lamina.cli import main

    monkeypatch.delenv("LAMINA_PORT", raising=False)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where each stack makes its directory
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert main(["up", "--port", str(port), "--layout", "colocated"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"lamina up: port {port} on 127.0.0.1 is taken (Address already in use): choose another "
                       "with --port, gateway.port or LAMINA_PORT")
        from lamina.services.config import load_config
        from lamina.services.launch.launcher import Stack

        with pytest.raises(RuntimeError, match=f"port {port} on 127.0.0.1 is taken"):  # the API's refusal
            Stack(load_config(env={}, overrides={"gateway.port": port})).start()
        config = tmp_path / "stack.yaml"
        local_stacks.publish(port, config)  # as a live lamina up (this process) leaves it
        assert main(["up", "--port", str(port), "--layout", "colocated"]) == 2
        assert f"by a lamina up (`lamina status --port {port}` shows it)" in capsys.readouterr().err
        assert local_stacks.find(port) == config
    assert os.listdir(scratch) == []
    from lamina.services.launch.launcher import gateway_port_taken

    assert gateway_port_taken(load_config(env={}, overrides={"gateway.port": 0})) is None  # any port will do
    # An address this host does not have: no port is free there, and none is said to be taken.
    assert gateway_port_taken(load_config(env={}, overrides={"host": "192.0.2.1", "gateway.port": 8000})) == \
        "the gateway cannot listen on 192.0.2.1 port 8000: Cannot assign requested address"


def test_lamina_up_with_a_log_dir_it_cannot_make_says_so_in_one_line(runtime, tmp_path, capsys, monkeypatch):
    """`--log-dir` under a file: one line naming it, exit 2, no stack directory left."""
    import tempfile

    from lamina.cli import main
    from lamina.ports import free_port

    monkeypatch.delenv("LAMINA_PORT", raising=False)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    (tmp_path / "a-file").write_text("")
    logs = tmp_path / "a-file" / "logs"
    assert main(["up", "--port", str(free_port()), "--layout", "colocated", "--log-dir", str(logs)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("lamina up: --log-dir: ") and str(logs) in err[-1]
    assert os.listdir(scratch) == []


@pytest.mark.parametrize(("model", "problem"), [
    ("missing.gguf", "no such file or directory"),
    ("notes.txt", "expected a .gguf file or a Hugging Face checkpoint directory"),
    ("random:llama-9b", "no random model shape 'llama-9b'"),
])
@pytest.mark.parametrize("layout", [[], ["--layout", "colocated"]])
def test_lamina_up_with_a_model_it_cannot_load_says_so_in_one_line(runtime, tmp_path, capsys, monkeypatch, model,
                                                                  problem, layout):
    """Before the machine is measured (layout auto) or any service starts: one line naming
    the file and the problem, exit 2 (it was a traceback from the layout's planning or
    the stack's start)."""
    from lamina.cli import main
    from lamina.ports import free_port

    monkeypatch.delenv("LAMINA_PORT", raising=False)
    (tmp_path / "notes.txt").write_text("not a model")
    name = model if model.startswith("random:") else str(tmp_path / model)
    assert main(["up", "--port", str(free_port()), "--model", name, *layout]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lamina up: cannot load model: {name}: {problem}") and len(err.splitlines()) == 1
    assert not runtime.exists() or not os.listdir(runtime)  # no stack was published


@pytest.mark.parametrize("argv", [["gateway"], ["scheduler"], ["prefill", "--index", "0"], ["model", "--index", "0"],
                                  ["attention", "--index", "0"]])
def test_each_service_with_a_model_it_cannot_load_says_so_in_one_line(tmp_path, capsys, monkeypatch, argv):
    """Started on its own: exit 2 and one line, before it waits for Redis (none here)."""
    from lamina.cli import main

    missing = tmp_path / "missing.gguf"
    monkeypatch.setenv("LAMINA_MODEL", str(missing))
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1")
    assert main(argv) == 2
    assert capsys.readouterr().err == f"lamina {argv[0]}: cannot load model: {missing}: no such file or directory\n"
