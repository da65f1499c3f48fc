"""The launcher's health check (`health_ok`): a gateway's /health answering 200 is healthy;
a refused port, an error status and a peer that is not an HTTP server are not (the last
once raised out of `Stack.start` instead)."""

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from lamina.services.launch.launcher import health_ok


@contextmanager
def _server(reply: bytes) -> Iterator[int]:
    """A one-thread server on 127.0.0.1 answering every connection with `reply`; its port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.05)  # how soon the thread sees `done`
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                conn.recv(4096)
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        thread.join(5)
        listener.close()


def test_only_an_http_200_is_healthy():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    with _server(ok) as port:
        assert health_ok(f"http://127.0.0.1:{port}")
    with _server(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n") as port:
        assert not health_ok(f"http://127.0.0.1:{port}")
    with _server(b"\x00\x00\x00\x40\x00\x00\x00\x40\xfe\x00\x00\x00\x3f\r\n") as port:  # a binary frame
        assert not health_ok(f"http://127.0.0.1:{port}")
    with socket.socket() as s:  # nothing listens here
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    assert not health_ok(f"http://127.0.0.1:{closed}")


def test_lamina_health_probes_one_target(capsys):
    """Its exit status is one target's health: --grpc and --http together are refused
    (the second was ignored)."""
    import pytest

    from lamina.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["health", "--grpc", "127.0.0.1:1", "--http", "http://127.0.0.1:1/health"])
    assert exited.value.code == 2
    assert "argument --http: not allowed with argument --grpc" in capsys.readouterr().err
