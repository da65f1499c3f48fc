"""Authentication without a stack: the cluster token on gRPC (a real server started by
ServiceRuntime.start_grpc, real channels), the gateway's refusal to serve an open API
beyond loopback, and the shared-memory transport's same-user rule."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transport_helpers import echo

from lamina import transports
from lamina.gateway.config import GatewayConfig, is_loopback
from lamina.services.auth import TOKEN_METADATA_KEY, token_matches
from lamina.services.channels import open_channel
from lamina.services.config import ConfigError, GatewaySection, StackConfig, load_config
from lamina.services.gateway.gateway_service import gateway_config
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.runtime import ServiceRuntime

TOKEN = "cluster-secret"
REPO = Path(__file__).resolve().parents[2]


class _Attention(lamina_pb2_grpc.AttentionControlServicer):
    """Records the Free calls that got through, and the metadata of the last Stats call."""

    def __init__(self) -> None:
        self.freed: list[str] = []
        self.metadata: dict[str, str] = {}

    async def Free(self, request, context):  # noqa: N802 (gRPC method names)
        self.freed.extend(request.seq_ids)
        return lamina_pb2.Empty()

    async def Stats(self, request, context):  # noqa: N802
        self.metadata = dict(context.invocation_metadata())
        return lamina_pb2.AttentionStats()


class _Model(lamina_pb2_grpc.ModelWorkerServicer):
    """Decode answers each update with one result (a stream-stream method)."""

    async def Decode(self, request_iterator, context):  # noqa: N802
        async for _update in request_iterator:
            yield lamina_pb2.DecodeResult()


@pytest.fixture
async def server(request):
    """A gRPC server of the stack, started the way every service starts it; the
    parameter is its cluster token."""
    token = getattr(request, "param", TOKEN)
    runtime = ServiceRuntime("attention", "attention-0",
                             StackConfig(redis_url="redis://127.0.0.1:1", cluster_token=token))
    attention = _Attention()

    def add(srv):
        lamina_pb2_grpc.add_AttentionControlServicer_to_server(attention, srv)
        lamina_pb2_grpc.add_ModelWorkerServicer_to_server(_Model(), srv)

    address = await runtime.start_grpc(add)
    try:
        yield address, attention
    finally:
        await runtime._server.stop(grace=None)
        await runtime.store.close()


def test_token_matches():
    assert token_matches(TOKEN, TOKEN) and token_matches(TOKEN.encode(), TOKEN)
    assert not token_matches(None, TOKEN)
    assert not token_matches("", TOKEN)
    assert not token_matches(TOKEN[:-1], TOKEN)
    assert not token_matches(TOKEN + "x", TOKEN)


async def _code(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value.code()


async def test_calls_without_the_token_are_refused(server):
    address, attention = server
    free = lamina_pb2.FreeRequest(seq_ids=["r1"])
    async with grpc.aio.insecure_channel(address) as ch:
        stub = lamina_pb2_grpc.AttentionControlStub(ch)
        assert await _code(stub.Free(free, timeout=10)) == grpc.StatusCode.UNAUTHENTICATED
        assert await _code(stub.Free(free, timeout=10, metadata=((TOKEN_METADATA_KEY, "wrong"),))) \
            == grpc.StatusCode.UNAUTHENTICATED
        # The health service stays open to probes.
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status in (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING)
    async with open_channel(address, "wrong") as ch:
        assert await _code(lamina_pb2_grpc.AttentionControlStub(ch).Free(free, timeout=10)) \
            == grpc.StatusCode.UNAUTHENTICATED
    assert attention.freed == []
    async with open_channel(address, TOKEN) as ch:
        await lamina_pb2_grpc.AttentionControlStub(ch).Free(free, timeout=10)
    assert attention.freed == ["r1"]


async def test_a_refused_stream_ends_before_any_request(server):
    """A stream-stream call without the token ends at once, even though the client never
    writes: the refusal matches the method's kind."""
    address, _ = server
    async with grpc.aio.insecure_channel(address) as ch:
        call = lamina_pb2_grpc.ModelWorkerStub(ch).Decode(timeout=10)
        assert await _code(call.read()) == grpc.StatusCode.UNAUTHENTICATED
    async with open_channel(address, TOKEN) as ch:
        call = lamina_pb2_grpc.ModelWorkerStub(ch).Decode(timeout=10)
        await call.write(lamina_pb2.DecodeUpdate())
        assert isinstance(await call.read(), lamina_pb2.DecodeResult)
        await call.done_writing()


async def test_the_token_travels_beside_the_callers_metadata(server):
    address, attention = server
    async with open_channel(address, TOKEN) as ch:
        await lamina_pb2_grpc.AttentionControlStub(ch).Stats(lamina_pb2.Empty(), timeout=10,
                                                             metadata=(("x-caller", "test"),))
    assert (attention.metadata[TOKEN_METADATA_KEY], attention.metadata["x-caller"]) == (TOKEN, "test")


@pytest.mark.parametrize("server", [None], indirect=True)
async def test_a_service_without_a_token_serves_everyone(server):
    address, attention = server
    async with grpc.aio.insecure_channel(address) as ch:
        await lamina_pb2_grpc.AttentionControlStub(ch).Free(lamina_pb2.FreeRequest(seq_ids=["r2"]), timeout=10)
    async with open_channel(address, TOKEN) as ch:  # a caller with a token is served too
        await lamina_pb2_grpc.AttentionControlStub(ch).Free(lamina_pb2.FreeRequest(seq_ids=["r3"]), timeout=10)
    assert attention.freed == ["r2", "r3"]


def test_the_warning_without_a_token_is_logged_when_the_server_starts(caplog):
    from lamina.services.auth import server_interceptors

    with caplog.at_level(logging.WARNING, logger="lamina.services.auth"):
        assert server_interceptors(None, "scheduler-0") == []
        assert len(server_interceptors(TOKEN, "scheduler-0")) == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "scheduler-0: no cluster_token" in warnings[0]


# -- the gateway beyond loopback -------------------------------------------------------------
def test_loopback_hosts():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "", "::", "10.0.0.5", "example.com"))


def test_the_gateway_refuses_an_open_api_beyond_loopback():
    with pytest.raises(ValueError, match=r"gateway\.api_key .* gateway\.insecure: true \(--insecure\)"):
        GatewayConfig(host="0.0.0.0")
    GatewayConfig(host="0.0.0.0", api_key="k")
    GatewayConfig(host="0.0.0.0", insecure=True)
    GatewayConfig(host="::1")
    with pytest.raises(ConfigError, match=r"^configuration: the gateway would serve the API without a key on "
                                          r"'0\.0\.0\.0'"):
        gateway_config(StackConfig(host="0.0.0.0"))
    assert gateway_config(StackConfig(host="0.0.0.0", gateway=GatewaySection(insecure=True))).insecure


def test_gateway_insecure_from_file_and_flag(tmp_path):
    f = tmp_path / "stack.yaml"
    f.write_text("host: 0.0.0.0\ngateway: {insecure: true}\n")
    assert gateway_config(load_config(f, env={})).insecure
    f.write_text("host: 0.0.0.0\n")
    assert gateway_config(load_config(f, env={}, overrides={"gateway.insecure": True})).insecure
    assert gateway_config(load_config(f, env={"LAMINA_API_KEY": "k"})).api_key == "k"


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_lamina_gateway_and_up_refuse_before_starting_anything(tmp_path, command):
    f = tmp_path / "stack.yaml"
    f.write_text("host: 0.0.0.0\nredis_url: redis://127.0.0.1:1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINA_")}
    out = subprocess.run([sys.executable, "-m", "lamina.cli", command, "--config", str(f)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "gateway.api_key" in out.stderr and "--insecure" in out.stderr
    assert "starting" not in out.stderr  # lamina up stopped before starting Redis or a service


# -- the shared-memory socket admits its own user only ---------------------------------------
SYSTEM_PYTHON = "/usr/bin/python3"  # one that another user may run (the venv's may sit in /root)


@pytest.mark.skipif(os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="connecting as another user needs root and a system python3")
async def test_shm_refuses_another_user():
    """A process of another uid connects to a listener's socket: it is closed before the
    handshake (it never sees the server's hello), while the same user gets the hello."""
    from lamina.transports.handshake import SERVER_HELLO_SIZE
    from lamina.transports.shm import socket_address


    name = f"auth-test-{os.getpid()}"
    probe = ("import socket, sys\n"
             "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
             f"s.connect({socket_address(name)!r})\n"
             "s.settimeout(10)\n"
             "data = b''\n"
             f"while len(data) < {SERVER_HELLO_SIZE}:\n"
             "    chunk = s.recv(64)\n"
             "    if not chunk: break\n"
             "    data += chunk\n"
             "print(len(data))\n")
    listener = await transports.listen(f"shm://{name}", echo, transports.TransportConfig())
    async with listener:
        import asyncio

        def run(user):
            return subprocess.run([SYSTEM_PYTHON, "-c", probe], user=user, capture_output=True, text=True,
                                  timeout=30, cwd="/")

        other = await asyncio.to_thread(run, 65534)
        same = await asyncio.to_thread(run, None)
    assert other.stdout.strip() == "0", other.stderr
    assert same.stdout.strip() == str(SERVER_HELLO_SIZE), same.stderr


async def test_shm_connects_the_same_user():

    listener = await transports.listen(f"shm://auth-same-{os.getpid()}", echo,
                                       transports.TransportConfig(auth_token=TOKEN))
    async with listener:
        async with await transports.connect(listener.address, transports.TransportConfig(auth_token=TOKEN)) as c:
            await c.send(transports.Frame(1, {"ok": True}))
            assert (await c.recv()).header == {"ok": True}


# -- the other services beyond loopback ------------------------------------------------------
def test_a_service_without_a_token_is_refused_beyond_loopback_unless_insecure():
    from lamina.services.auth import open_service_refusal

    why = open_service_refusal(StackConfig(host="0.0.0.0"), "scheduler")
    assert why is not None and "scheduler would serve on '0.0.0.0'" in why and "cluster_token" in why
    assert "--insecure" in why
    assert open_service_refusal(StackConfig(host="0.0.0.0", cluster_token="t"), "scheduler") is None
    assert open_service_refusal(StackConfig(host="0.0.0.0", insecure=True), "scheduler") is None
    assert open_service_refusal(StackConfig(host="127.0.0.1"), "scheduler") is None
    assert load_config(env={"LAMINA_INSECURE": "true"}).insecure is True
    # The variable's text is read as a boolean: "false" is not a truthy string.
    assert load_config(env={"LAMINA_INSECURE": "false"}).insecure is False
    assert load_config(env={"LAMINA_INSECURE": "0"}).insecure is False
    with pytest.raises(ConfigError, match="insecure must be true or false"):
        load_config(env={"LAMINA_INSECURE": "maybe"})


@pytest.mark.parametrize("argv", [["scheduler"], ["model", "--index", "0"], ["attention", "--index", "0"],
                                  ["prefill", "--index", "0"]])
def test_each_service_refuses_to_start_open_beyond_loopback(tmp_path, argv):
    """One line, exit 2, before the service loads a model or reaches Redis (whose URL
    here answers nothing)."""
    f = tmp_path / "stack.yaml"
    f.write_text("host: 0.0.0.0\nredis_url: redis://127.0.0.1:1\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAMINA_")}
    out = subprocess.run([sys.executable, "-m", "lamina.cli", *argv, "--config", str(f)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "without a cluster token" in out.stderr and "--insecure" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
