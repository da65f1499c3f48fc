"""The deploy files cannot drift from the code: compose validates with docker compose, every
Kubernetes manifest against the Kubernetes schema, and every command they give our
services is accepted by the CLI's own parsers with a configuration that loads."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from lamina.cli import COMMANDS
from lamina.services.config import StackConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
K8S_DIR = ROOT / "deploy" / "k8s"
K8S_VERSION = "1.35.0"  # a recent release whose schema kubernetes-validate ships
CONFIG_PATH = "/etc/lamina/stack.yaml"  # where both deployments mount the stack configuration
WORKER_SECTIONS = {"attention": "attention", "model": "model_worker", "prefill": "prefill"}


def parse_service_args(argv: list[str]) -> argparse.Namespace:
    """argv as `lamina` gets it, parsed by that subcommand's own parser."""
    assert argv[0] in COMMANDS, f"{argv[0]!r} is not a lamina command"
    parser = argparse.ArgumentParser(prog=f"lamina {argv[0]}")
    importlib.import_module(COMMANDS[argv[0]][0]).add_arguments(parser)
    try:
        return parser.parse_args(argv[1:])
    except SystemExit:
        pytest.fail(f"lamina rejects {argv}")


def _interpolate(value: str) -> str:
    """A compose value with ${VAR:-default} replaced by its default."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def _compose() -> dict[str, Any]:
    return yaml.safe_load((COMPOSE_DIR / "compose.yaml").read_text())


def _lamina_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in compose["services"].items() if "lamina" in _interpolate(s.get("image", ""))}


def _compose_cli() -> list[str] | None:
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    return None


def test_compose_file_validates():
    cli = _compose_cli()
    if cli is None:
        pytest.skip("neither docker-compose nor the docker compose plugin is installed (.ci/run installs "
                    "Debian's docker-compose when it runs as root)")
    # As a user does first (docs/deploy.md): Grafana's env_file must exist for `config`.
    subprocess.run(["sh", str(COMPOSE_DIR / "make-secrets.sh")], check=True, capture_output=True, timeout=60)
    result = subprocess.run([*cli, "-f", str(COMPOSE_DIR / "compose.yaml"), "config", "-q"],
                            capture_output=True, text=True, timeout=60, cwd=COMPOSE_DIR)
    assert result.returncode == 0, result.stderr


def _check_workers(config: StackConfig, indexes: dict[str, list[int]], where: str) -> None:
    """Each kind of worker runs with exactly the indexes 0..workers-1 of its section."""
    for kind, section in WORKER_SECTIONS.items():
        expected = list(range(getattr(config, section).workers))
        assert sorted(indexes.get(kind, [])) == expected, f"{where}: {kind} indexes vs {section}.workers"


def test_compose_commands_are_accepted_by_the_cli():
    compose = _compose()
    services = _lamina_services(compose)
    assert {"scheduler", "gateway", "prefill-0", "model-0", "attention"} <= set(services)
    config = None
    indexes: dict[str, list[int]] = {}
    for name, service in services.items():
        args = parse_service_args(service["command"])
        assert args.config == CONFIG_PATH
        assert f"./stack.yaml:{CONFIG_PATH}:ro" in service["volumes"]
        env = {k: _interpolate(v) for k, v in service["environment"].items() if not k.endswith("_FILE")}
        config = load_config(COMPOSE_DIR / "stack.yaml", env=env)
        assert config.host == "0.0.0.0" and config.redis_url == "redis://redis:6379/0"
        # The image's HEALTHCHECK, through the entrypoint (which leaves root).
        assert service["healthcheck"]["test"] == "lamina-entrypoint health"
        if service["command"][0] in WORKER_SECTIONS and args.index == "auto":
            # Replicas claim indexes 0..replicas-1; the same variable sets the count the stack waits for.
            replicas = int(_interpolate(service["deploy"]["replicas"]))
            indexes.setdefault(service["command"][0], []).extend(range(replicas))
            assert service["deploy"]["replicas"] == service["environment"]["LAMINA_ATTENTION_WORKERS"]
            # the pool is elastic: `--scale attention=N` up to max_workers joins it
            assert config.attention.pool_limit > config.attention.workers
        elif service["command"][0] in WORKER_SECTIONS:
            indexes.setdefault(service["command"][0], []).append(args.index)
            assert name == f"{service['command'][0]}-{args.index}"
        if service["command"][0] == "gateway":
            assert config.ports.grpc == 0, "the image's HEALTHCHECK must probe the gateway's /health"
            assert any(p.endswith(f":{config.gateway.port}") for p in service["ports"])
        else:
            assert config.ports.grpc and config.ports.metrics
    _check_workers(config, indexes, "compose.yaml")


def test_prometheus_scrapes_every_compose_service():
    services = _lamina_services(_compose())
    prometheus = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    # Replicated services are found by their name's addresses, one target per replica.
    targets |= {f"{name}:{sd['port']}" for job in prometheus["scrape_configs"] for sd in job.get("dns_sd_configs", [])
                for name in sd["names"]}
    config = load_config(COMPOSE_DIR / "stack.yaml", env={})
    expected = {f"{name}:{config.gateway.port if s['command'][0] == 'gateway' else config.ports.metrics}"
                for name, s in services.items()}
    assert targets == expected


def test_the_image_copies_every_package_and_probes_health():
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    # lamina/ and every folder its links point at (README, "Packages")
    packages = ["lamina"] + sorted(p.name for p in (ROOT / "lamina").iterdir() if p.is_symlink())
    assert "services" in packages and "csrc" in packages
    for package in packages:
        assert f"COPY {package}/ {package}/" in dockerfile, f"the image build misses {package}/"
    assert 'CMD ["lamina", "health"]' in dockerfile
    parse_service_args(["health"])
    assert os.access(COMPOSE_DIR / "entrypoint.sh", os.X_OK)


def _k8s_documents() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in sorted(K8S_DIR.rglob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]


def test_every_kubernetes_manifest_validates():
    kubernetes_validate = pytest.importorskip("kubernetes_validate",
                                              reason="pip install kubernetes-validate (dev extra)")
    documents = _k8s_documents()
    assert {doc["kind"] for _, doc in documents} >= {"Deployment", "StatefulSet", "Service", "ConfigMap", "Secret",
                                                      "HorizontalPodAutoscaler"}
    for path, doc in documents:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.relative_to(ROOT)}: {doc['kind']}/{doc['metadata']['name']}: {exc.message}")


def _lamina_containers(documents) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(doc, c) for _, doc in documents if doc["kind"] in ("Deployment", "StatefulSet")
            for c in doc["spec"]["template"]["spec"]["containers"] if c["image"].startswith("lamina")]


def test_kubernetes_args_are_accepted_by_the_cli(tmp_path):
    documents = _k8s_documents()
    (configmap,) = [doc for _, doc in documents if doc["kind"] == "ConfigMap"]
    (tmp_path / "stack.yaml").write_text(configmap["data"]["stack.yaml"])
    indexes: dict[str, list[int]] = {}
    config = None
    for workload, container in _lamina_containers(documents):
        kind = container["args"][0]
        replicas = workload["spec"]["replicas"]
        # A StatefulSet's pods get their ordinal as --index; a Deployment runs one fixed index.
        argv = [a.replace("$(POD_INDEX)", "0") for a in container["args"]]
        args = parse_service_args(argv)
        assert args.config == CONFIG_PATH
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        env["LAMINA_ADVERTISE_HOST"] = "10.0.0.1"  # the pod IP, from the downward API
        assert {"LAMINA_ADVERTISE_HOST", "LAMINA_CLUSTER_TOKEN"} <= {e["name"] for e in container["env"]}
        config = load_config(tmp_path / "stack.yaml", env=env)
        if kind in WORKER_SECTIONS:
            count = replicas if "$(POD_INDEX)" in container["args"] else 1
            indexes.setdefault(kind, []).extend(range(count) if count > 1 else [args.index])
        probes = [container[p] for p in ("startupProbe", "readinessProbe", "livenessProbe")]
        if kind == "gateway":
            assert all(p["httpGet"]["path"] == "/health" for p in probes)
            assert container["ports"][0]["containerPort"] == config.gateway.port
        else:
            assert all(p["grpc"]["port"] == config.ports.grpc for p in probes)
            # Ready once registered: the runtime sets its kind's health status (services/runtime.py).
            assert [p["grpc"].get("service", "") for p in probes] == [kind, kind, ""]
    _check_workers(config, indexes, "deploy/k8s")
    # The autoscaler's range is what the elastic pool takes: from the count the stack
    # waits for at start up to attention.max_workers.
    (hpa,) = [doc for _, doc in documents if doc["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "attention"
    assert hpa["spec"]["minReplicas"] == config.attention.workers
    assert config.attention.workers < hpa["spec"]["maxReplicas"] <= config.attention.pool_limit


def test_model_and_attention_workers_land_on_different_node_pools():
    pools = {c["args"][0]: doc["spec"]["template"]["spec"].get("nodeSelector")
             for doc, c in _lamina_containers(_k8s_documents())}
    assert pools["model"] and pools["attention"] and pools["model"] != pools["attention"]


def test_prometheus_and_grafana_are_on_loopback_and_grafana_has_a_secret_password():
    compose = _compose()
    for name in ("prometheus", "grafana"):
        (published,) = compose["services"][name]["ports"]
        assert _interpolate(published).startswith("127.0.0.1:"), (name, published)
    grafana = compose["services"]["grafana"]
    assert grafana["env_file"] == ["./secrets/grafana.env"]  # make-secrets.sh writes it (below)
    assert "GF_SECURITY_ADMIN_PASSWORD" not in grafana.get("environment", {})


def test_make_secrets_keeps_its_directory_to_its_user(tmp_path):
    import stat

    shutil.copy(COMPOSE_DIR / "make-secrets.sh", tmp_path)
    subprocess.run(["sh", str(tmp_path / "make-secrets.sh")], check=True, capture_output=True, timeout=60)
    secrets_dir = tmp_path / "secrets"
    assert stat.S_IMODE(secrets_dir.stat().st_mode) == 0o700
    made = sorted(p.name for p in secrets_dir.iterdir())
    assert made == ["api_key", "cluster_token", "grafana.env", "grafana_admin_password"]
    assert all(stat.S_IMODE((secrets_dir / n).stat().st_mode) == 0o600 for n in made)
    tokens = [n for n in made if "." not in n]
    assert all(len((secrets_dir / n).read_text().strip()) >= 40 for n in tokens)  # 32 random bytes, url-safe
    password = (secrets_dir / "grafana_admin_password").read_text().strip()
    assert (secrets_dir / "grafana.env").read_text() == f"GF_SECURITY_ADMIN_PASSWORD={password}\n"
    first = (secrets_dir / "api_key").read_text()
    (secrets_dir / "grafana_admin_password").write_text("changed\n")
    subprocess.run(["sh", str(tmp_path / "make-secrets.sh")], check=True, capture_output=True, timeout=60)
    assert (secrets_dir / "api_key").read_text() == first  # kept, not remade
    assert (secrets_dir / "grafana.env").read_text() == "GF_SECURITY_ADMIN_PASSWORD=changed\n"  # follows it


def test_compose_reads_secrets_as_root_and_runs_services_as_the_image_user():
    compose = _compose()
    assert compose["x-lamina"]["user"] == "0:0"
    assert compose["x-lamina"]["healthcheck"]["test"] == "lamina-entrypoint health"
    entrypoint = (COMPOSE_DIR / "entrypoint.sh").read_text()
    assert "setpriv --reuid=lamina --regid=lamina --init-groups lamina" in entrypoint
