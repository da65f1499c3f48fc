"""Binding versus advertising: services in containers bind a wildcard on fixed ports and
register addresses their peers can reach; `lamina health` probes them."""

from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lamina.commands.health import grpc_serving, http_ok, probe_target
from lamina.ports import free_port
from lamina.services.addresses import advertised_host, host_port, with_host
from lamina.services.config import ConfigError, load_config
from lamina.services.runtime import ServiceRuntime


def test_environment_sets_host_advertised_host_and_ports():
    env = {"LAMINA_HOST": "0.0.0.0", "LAMINA_ADVERTISE_HOST": "10.1.2.3", "LAMINA_GRPC_PORT": "50051",
           "LAMINA_METRICS_PORT": "9100"}
    config = load_config(env=env)
    assert (config.host, config.advertise_host, config.ports.grpc, config.ports.metrics) == \
        ("0.0.0.0", "10.1.2.3", 50051, 9100)
    assert config.advertised_host == "10.1.2.3"
    defaults = load_config(env={})
    assert (defaults.host, defaults.advertised_host, defaults.ports.grpc, defaults.ports.metrics) == \
        ("127.0.0.1", "127.0.0.1", 0, 0)


def test_a_wildcard_is_never_advertised():
    assert advertised_host("0.0.0.0", None) == socket.gethostbyname(socket.gethostname())
    assert advertised_host("::", "pod-1.attention") == "pod-1.attention"
    assert advertised_host("10.0.0.5", None) == "10.0.0.5"


@pytest.mark.parametrize("env, message", [
    ({"LAMINA_GRPC_PORT": "70000"}, "ports.grpc must be a TCP port"),
    ({"LAMINA_METRICS_PORT": "-1"}, "ports.metrics must be a TCP port"),
    ({"LAMINA_GRPC_PORT": "x"}, "ports.grpc must be an integer"),
    ({"LAMINA_ADVERTISE_HOST": "0.0.0.0"}, "advertise_host must be an address peers can reach"),
])
def test_bad_address_settings_name_the_setting(env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(env=env)


def test_bound_addresses_get_the_advertised_host():
    assert with_host("tcp://0.0.0.0:41000", "10.0.0.7") == "tcp://10.0.0.7:41000"
    assert with_host("ucx://[::]:41000", "10.0.0.7") == "ucx://10.0.0.7:41000"
    assert with_host("0.0.0.0:50051", "fd00::7") == "[fd00::7]:50051"
    assert with_host("shm://lamina-attention-0-123", "10.0.0.7") == "shm://lamina-attention-0-123"
    assert host_port("::", 1) == "[::]:1"


def test_probe_target_from_flags_or_the_container_environment():
    assert probe_target("a:1", None, {}) == ("grpc", "a:1")
    assert probe_target(None, "http://g/health", {"LAMINA_GRPC_PORT": "5"}) == ("http", "http://g/health")
    assert probe_target(None, None, {"LAMINA_GRPC_PORT": "50051"}) == ("grpc", "127.0.0.1:50051")
    assert probe_target(None, None, {"LAMINA_GRPC_PORT": "0", "LAMINA_PORT": "8080"}) == \
        ("http", "http://127.0.0.1:8080/health")


def test_runtime_binds_all_interfaces_on_fixed_ports_and_advertises_a_reachable_host():
    grpc_port, metrics_port = free_port(), free_port()
    # No Redis is contacted: only the gRPC and metrics servers start.
    config = load_config(env={"REDIS_URL": "redis://127.0.0.1:1", "LAMINA_HOST": "0.0.0.0",
                              "LAMINA_ADVERTISE_HOST": "127.0.0.1", "LAMINA_GRPC_PORT": str(grpc_port),
                              "LAMINA_METRICS_PORT": str(metrics_port)})

    async def scenario() -> None:
        runtime = ServiceRuntime("attention", "attention-0", config)
        address = await runtime.start_grpc(lambda server: None)
        assert address == f"127.0.0.1:{grpc_port}"
        assert runtime.start_metrics() == metrics_port
        try:
            ok, status = await asyncio.to_thread(grpc_serving, address, "", 3.0)
            assert (ok, status) == (True, "SERVING")
            # Readiness probes name the kind: it answers SERVING only once the service is registered.
            assert not (await asyncio.to_thread(grpc_serving, address, "attention", 3.0))[0]
            await runtime._set_serving(True)
            assert await asyncio.to_thread(grpc_serving, address, "attention", 3.0) == (True, "SERVING")
            assert (await asyncio.to_thread(http_ok, f"http://127.0.0.1:{metrics_port}/metrics", 3.0))[0]
        finally:
            await runtime._server.stop(None)
            runtime._metrics_server.shutdown()
            await runtime.store.close()

    asyncio.run(scenario())


def test_health_probe_fails_where_nothing_serves():
    ok, detail = grpc_serving(f"127.0.0.1:{free_port()}", "", 1.0)
    assert not ok and detail.startswith("UNAVAILABLE")

    class Draining(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name
            self.send_response(503)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Draining)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert http_ok(f"http://127.0.0.1:{server.server_port}/health", 2.0) == (False, "HTTP 503")
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_lamina_up_refuses_fixed_ports(monkeypatch, capsys):
    import argparse

    from lamina.commands import up

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    monkeypatch.setenv("LAMINA_GRPC_PORT", "50051")
    assert up.run(parser.parse_args([])) == 2
    assert "ports.grpc and ports.metrics must be 0" in capsys.readouterr().err
