"""Conformance suite: every transport the machine can run passes the same tests, over
real sockets / shared memory / UCX endpoints and real peer processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from transport_helpers import address_for, byte_stream, echo, open_fds, transport_tasks

from lamina import transports
from lamina.transports import (
    AuthError,
    Frame,
    FrameError,
    PeerClosed,
    TransportConfig,
    TransportTimeout,
)
from lamina.transports.frame import encode
from lamina.transports.polling import BusyPoll

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True, params=["native", "python"])
def codec(request, monkeypatch) -> str:
    """Every test runs with each frame codec (the peer child processes keep the default,
    so those tests also cross the two)."""
    if request.param == "native":
        if transports.frame.NATIVE is None:
            pytest.skip("native frame codec not built (transports/_wire needs a C compiler "
                        "and zlib headers at install)")
    else:
        monkeypatch.setattr(transports.frame, "NATIVE", None)
    return request.param

CHILD = os.path.join(os.path.dirname(__file__), "peer_child.py")


async def pair(address, handler=echo, server_config=None, client_config=None):
    listener = await transports.listen(address, handler, server_config)
    conn = await transports.connect(listener.address, client_config)
    return listener, conn


async def test_ordering(address):
    listener, conn = await pair(address)
    async with listener, conn:
        for i in range(200):
            await conn.send(Frame(7, {"seq": i}, [torch.tensor([i])]))
        for i in range(200):
            f = await conn.recv()
            assert (f.kind, f.header["seq"], f.tensors[0].item()) == (7, i, i)


@pytest.mark.parametrize("nbytes", [1, 1000, 1 << 20, 64 << 20])
async def test_frame_sizes(address, nbytes):
    listener, conn = await pair(address)
    async with listener, conn:
        payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        await conn.send(Frame(1, {"n": nbytes}, [payload]))
        got = await conn.recv()
        assert got.header == {"n": nbytes} and torch.equal(got.tensors[0], payload)


async def test_header_larger_than_receive_scratch(address):
    listener, conn = await pair(address)
    async with listener, conn:
        blob = "h" * (400 << 10)  # beyond TCP's 256 KiB scratch buffer
        await conn.send(Frame(5, {"blob": blob}, [torch.arange(3)]))
        got = await conn.recv()
        assert got.header == {"blob": blob} and torch.equal(got.tensors[0], torch.arange(3))


async def test_many_small_frames_pipelined(address):
    listener, conn = await pair(address)
    n = 3000

    async def produce():
        for i in range(n):
            await conn.send(Frame(2, {"i": i}, [b"x" * (i % 17)]))

    async with listener, conn:
        producer = asyncio.create_task(produce())
        for i in range(n):
            f = await conn.recv()
            assert f.header["i"] == i and bytes(f.tensors[0]) == b"x" * (i % 17)
        await producer


async def test_many_concurrent_connections(address):
    listener = await transports.listen(address, echo)

    async def client(k: int) -> None:
        async with await transports.connect(listener.address) as conn:
            for i in range(20):
                t = torch.full((k + 1, 3), float(i))
                await conn.send(Frame(k, {"i": i}, [t]))
                f = await conn.recv()
                assert f.kind == k and f.header["i"] == i and torch.equal(f.tensors[0], t)

    async with listener:
        await asyncio.gather(*(client(k) for k in range(24)))


async def test_dtypes_and_layouts(address):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = [
        base, base.t(), base[:, ::2], base.to(torch.float16), base.to(torch.bfloat16),
        base.to(torch.float64), base.to(torch.int64), base.to(torch.int8), base > 10,
        torch.complex(base, -base), base.to(torch.float8_e4m3fn), torch.tensor(3.5),
        torch.empty(0, 5), torch.empty(2, 0, dtype=torch.int32),
    ]
    raw = bytearray(b"raw bytes")
    listener, conn = await pair(address)
    async with listener, conn:
        await conn.send(Frame(3, {"nested": {"a": [1, 2.5, "s", None, b"b"]}}, tensors + [raw]))
        f = await conn.recv()
    assert f.header == {"nested": {"a": [1, 2.5, "s", None, b"b"]}}
    for sent, got in zip(tensors, f.tensors):
        assert got.dtype == sent.dtype and got.shape == sent.shape and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           sent.contiguous().view(torch.uint8) if sent.dtype == torch.float8_e4m3fn else sent)
    assert f.tensors[-1] == raw


async def test_recv_into_preallocated(address):
    listener, conn = await pair(address)
    async with listener, conn:
        src = torch.randn(64, 32)
        out = torch.empty(64, 32)
        await conn.send(Frame(1, {}, [src, b"abc"]))
        f = await conn.recv(out=[out])
        assert f.tensors[0] is out and torch.equal(out, src) and bytes(f.tensors[1]) == b"abc"
        await conn.send(Frame(1, {}, [src]))
        with pytest.raises(FrameError, match="out buffer"):
            await conn.recv(out=[torch.empty(3)])


@pytest.mark.parametrize("busy_poll_us", [0.0, 50.0])
async def test_sizes_around_buffer_boundaries(address, busy_poll_us):
    # Around UCX's one-message limit and the shared-memory parse-in-place limit (64 KiB),
    # TCP's 256 KiB scratch buffer, and through a 64 KiB ring that wraps many times;
    # small frames in between, received into reused and fresh buffers.
    config = TransportConfig(busy_poll_us=busy_poll_us, shm_ring_bytes=64 << 10)
    listener, conn = await pair(address, server_config=config, client_config=config)
    sizes = [(64 << 10) - 80, (64 << 10) - 33, 64 << 10, (64 << 10) + 1, (256 << 10) - 100,
             (256 << 10) + 1, 3, 40_000, 17, 100_000, 1]
    async with listener, conn:
        for round_ in range(3):
            for k, n in enumerate(sizes):
                payload = torch.randint(0, 255, (n,), dtype=torch.uint8)
                await conn.send(Frame(4, {"k": k, "r": round_}, [payload, b"tail"]))
                out = [torch.empty(n, dtype=torch.uint8)] if k % 2 else None
                f = await conn.recv(out=out)
                assert f.header == {"k": k, "r": round_}
                assert torch.equal(f.tensors[0], payload) and bytes(f.tensors[1]) == b"tail"
                if out is not None:
                    assert f.tensors[0] is out[0]


async def test_recv_into_the_same_buffer_frame_after_frame(address):
    listener, conn = await pair(address)
    async with listener, conn:
        out = torch.empty(16, 8)
        for i in range(50):
            await conn.send(Frame(1, {}, [torch.full((16, 8), float(i))]))
            f = await conn.recv(out=[out])
            assert f.tensors[0] is out and bool((out == i).all())
        other = torch.empty(16, 8)  # a new destination is used, not the cached one
        await conn.send(Frame(1, {}, [torch.full((16, 8), -1.0)]))
        await conn.recv(out=[other])
        assert bool((other == -1).all()) and bool((out == 49).all())
        out.resize_(4, 8)  # same tensor, other size: refused, not written past its end
        await conn.send(Frame(1, {}, [torch.zeros(16, 8)]))
        with pytest.raises(FrameError, match="out buffer"):
            await conn.recv(out=[out])


async def test_slow_peer_with_busy_polling(address):
    # The receiver spins, runs out of budget, parks, and still gets every frame.
    async def slow_echo(conn):
        while True:
            frame = await conn.recv()
            await asyncio.sleep(0.005)
            await conn.send(frame)

    config = TransportConfig(busy_poll_us=200.0)
    listener, conn = await pair(address, slow_echo, client_config=config, server_config=config)
    async with listener, conn:
        for i in range(10):
            await conn.send(Frame(1, {"i": i}, [torch.tensor([i])]))
            f = await conn.recv()
            assert f.header == {"i": i} and f.tensors[0].item() == i


async def test_corrupted_frame_closes_only_that_connection(scheme, address):
    listener = await transports.listen(address, echo)
    async with listener:
        bad = await transports.connect(listener.address)
        head, views = encode(Frame(1, {"k": "v"}, [torch.ones(4)]), checksum_payloads=False,
                             max_frame_bytes=1 << 20)
        corrupted = bytearray(head)
        corrupted[-2] ^= 0xFF  # inside the msgpack header: caught by its crc
        if scheme == "ucx":  # a small frame is one UCX message
            await bad._write([memoryview(bytes(corrupted) + bytes(views[0]))])
        else:
            await byte_stream(bad)._write([memoryview(corrupted), views[0]])
        with pytest.raises(PeerClosed):  # the listener dropped this connection
            await bad.recv(timeout=10)
        await bad.close()
        good = await transports.connect(listener.address)  # and still serves others
        async with good:
            await good.send(Frame(1, {}, [torch.ones(2)]))
            assert torch.equal((await good.recv()).tensors[0], torch.ones(2))


async def test_garbage_and_oversized_frames(scheme, address):
    seen: list[BaseException] = []

    async def handler(conn):
        try:
            await conn.recv()
        except FrameError as exc:
            seen.append(exc)
            raise

    small = TransportConfig(max_frame_bytes=1 << 20)
    listener = await transports.listen(address, handler, small)
    async with listener:
        # Oversized: refused by the sender's own limit first...
        async with await transports.connect(listener.address, small) as conn:
            with pytest.raises(FrameError, match="max_frame_bytes"):
                await conn.send(Frame(1, {}, [torch.zeros(2 << 20, dtype=torch.uint8)]))
        # ...and by the receiver's when the sender allows more.
        async with await transports.connect(listener.address) as conn:
            with pytest.raises(PeerClosed):  # at send (UCX: no buffer in between) or recv
                await conn.send(Frame(1, {}, [torch.zeros(2 << 20, dtype=torch.uint8)]))
                await conn.recv(timeout=10)
        if scheme != "ucx":  # a byte stream: bytes that are no frame at all
            async with await transports.connect(listener.address) as conn:
                await byte_stream(conn)._write([memoryview(b"GET / HTTP/1.1\r\n\r\n" + bytes(32))])
                with pytest.raises(PeerClosed):
                    await conn.recv(timeout=10)
        deadline = time.monotonic() + 5
        # The listener's error hook is a plain callback: there is no event to wait on.
        # One error for the oversized frame the receiver refused, one for the bytes that are no frame.
        while len(seen) < (1 if scheme == "ucx" else 2) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    messages = " | ".join(str(e) for e in seen)
    assert "max_frame_bytes" in messages
    if scheme != "ucx":
        assert "magic" in messages


async def test_recv_timeout(scheme, address):
    listener, conn = await pair(address, server_config=None,
                                client_config=TransportConfig(recv_timeout=0.2))
    async with listener, conn:
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            await conn.recv()
        assert time.monotonic() - t0 < 2
        if scheme == "ucx":  # a posted UCX receive cannot be withdrawn: closed
            assert conn.closed
        else:  # timed out before the frame began: the connection is still usable
            await conn.send(Frame(1, {"after": "timeout"}))
            assert (await conn.recv()).header == {"after": "timeout"}


async def test_backpressure_bounds_sender(scheme, address):
    stalled = asyncio.Event()

    async def never_reads(conn):
        await stalled.wait()

    cfg = TransportConfig(send_timeout=1.0, shm_ring_bytes=1 << 20, socket_buffer_bytes=1 << 20)
    listener, conn = await pair(address, never_reads, cfg, cfg)
    async with listener, conn:
        payload = torch.zeros(4 << 20, dtype=torch.uint8)
        sent = 0
        with pytest.raises(TransportTimeout):
            for _ in range(64):  # 256 MiB: far more than any transport buffer here
                await conn.send(Frame(1, {}, [payload]))
                sent += 1
        assert sent < 16, f"{sent} frames of 4 MiB buffered for a receiver that never reads"
        assert conn.closed  # a send cut mid-frame leaves no usable stream
        stalled.set()


async def test_auth(address):
    token = TransportConfig(auth_token="cluster-secret")
    listener = await transports.listen(address, echo, token)
    async with listener:
        with pytest.raises(AuthError):
            await transports.connect(listener.address)
        with pytest.raises(AuthError):
            await transports.connect(listener.address, TransportConfig(auth_token="wrong"))
        async with await transports.connect(listener.address, token) as conn:
            await conn.send(Frame(1, {"ok": True}))
            assert (await conn.recv()).header == {"ok": True}
    # A client with a token refuses a server that cannot prove it knows the token.
    open_listener = await transports.listen(address_for(address.split(":")[0]), echo)
    async with open_listener:
        with pytest.raises(AuthError):
            await transports.connect(open_listener.address, token)


def _spawn(*args) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, CHILD, *args], stdout=subprocess.PIPE, text=True, env=env)


async def _readline(proc: subprocess.Popen) -> str:
    return (await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)).strip()


async def test_sender_killed_mid_frame(address):
    errors: list[BaseException] = []
    got_one = asyncio.Event()

    async def handler(conn):
        try:
            while True:
                await conn.recv()
                got_one.set()
        except BaseException as exc:
            errors.append(exc)
            raise

    listener = await transports.listen(address, handler)
    async with listener:
        proc = _spawn("sender", listener.address)
        try:
            assert await _readline(proc) == "connected"
            await asyncio.wait_for(got_one.wait(), 30)
            proc.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            # The listener's error hook is a plain callback: there is no event to wait on.
            while not errors and time.monotonic() - t0 < 10:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        finally:
            proc.kill()
            proc.wait()
        assert errors and isinstance(errors[0], PeerClosed), errors
        assert time.monotonic() - t0 < 5
        async with await transports.connect(listener.address) as conn:  # still serving
            await conn.send(Frame(1, {"alive": 1}))


@pytest.fixture
async def streaming_echo(request):
    """(scheme, echo child's address, client connection spinning 10 ms) for the byte-stream
    transports, whose frames over their in-place size are streamed."""
    scheme = request.param
    proc = _spawn("echo", address_for(scheme))
    try:
        address = await _readline(proc)
        conn = await transports.connect(address, TransportConfig(busy_poll_us=10_000.0))
        try:
            yield scheme, conn
        finally:
            await conn.close()
    finally:
        proc.kill()
        proc.wait()


STREAMED = 300 << 10  # over TCP's scratch buffer (256 KiB) and shm's in-place size (64 KiB)


class CountedPoll(BusyPoll):
    """The busy-poll policy, counting its hits."""

    def __init__(self, budget_us: float) -> None:
        super().__init__(budget_us)
        self.hits = 0

    def hit(self) -> None:
        self.hits += 1
        super().hit()


@pytest.mark.parametrize("streaming_echo", ["tcp", "shm"], indirect=True)
async def test_a_streamed_frame_that_starts_while_the_wait_spins_is_a_hit(streaming_echo):
    # Without it the waits of a connection carrying such frames count only misses, and two
    # stray ones stop its spinning for good. Each round starts from a fresh policy, so each
    # wait spins (10 ms): one reply starting within it is enough, whatever the host's load.
    # The echo waits 2 ms before it answers: a peer woken on this process's core would
    # otherwise answer before this process looks at all, and such a wait does not spin.
    _, conn = streaming_echo
    payload = torch.randint(0, 255, (STREAMED,), dtype=torch.uint8)
    hits = 0
    for _ in range(10):
        poll = conn._poll = CountedPoll(10_000.0)
        await conn.send(Frame(1, {"sleep": 0.002}, [payload]))
        assert torch.equal((await conn.recv()).tensors[0], payload)
        hits += poll.hits
    assert hits > 0


@pytest.mark.parametrize("streaming_echo", ["tcp", "shm"], indirect=True)
async def test_a_streamed_frame_is_received_without_parking_between_its_pieces(streaming_echo, monkeypatch):
    # The rest of a frame the peer is sending now is microseconds away: the receiver spins
    # for it rather than parking in the event loop for each piece (4 MiB: 16 shm pieces).
    # Counted: parks inside _read_exact after a frame's preamble (on TCP, its payload's).
    scheme, conn = streaming_echo
    parks = 0
    inside = False
    park_name = "_sleep" if scheme == "shm" else "_wait_readable"
    park, read = getattr(conn, park_name), conn._read_exact

    async def counted_park():
        nonlocal parks
        parks += inside
        await park()

    async def marked_read(view, *, first=False):
        nonlocal inside
        inside = not first
        try:
            await read(view, first=first)
        finally:
            inside = False

    monkeypatch.setattr(conn, park_name, counted_park)
    monkeypatch.setattr(conn, "_read_exact", marked_read)
    payload = torch.randint(0, 255, (4 << 20,), dtype=torch.uint8)
    rounds = 8
    for _ in range(rounds):
        await conn.send(Frame(1, {}, [payload]))
        assert torch.equal((await conn.recv()).tensors[0], payload)
    assert parks <= 2, f"parked {parks} times inside {rounds} frames of 4 MiB"


@pytest.mark.parametrize("streaming_echo", ["shm"], indirect=True)
async def test_a_huge_frame_through_shm_leaves_the_event_loop_to_other_tasks(streaming_echo):
    # A peer as quick as this end keeps a 64 MiB frame's pieces coming (or the ring's
    # space freeing) within any spin, so nothing ever waits in the event loop: reads and
    # writes inside a frame give the loop a turn every millisecond, so the process's
    # other tasks (other connections) run while it travels.
    _, conn = streaming_echo
    ticks = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            await asyncio.sleep(0)

    payload = torch.randint(0, 255, (64 << 20,), dtype=torch.uint8)
    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    start = ticks
    try:
        await conn.send(Frame(1, {}, [payload]))
        assert torch.equal((await conn.recv()).tensors[0], payload)
    finally:
        stop.set()
        await task
    assert ticks - start >= 3, f"the event loop ran other tasks {ticks - start} times during a 64 MiB round trip"


def _shm_mappings(name: str) -> tuple[list[int], list[int]]:
    """Size and resident size (KiB) of each of this process's mappings of the rings of
    the shm connections made to `name` (their memfd is named after it)."""
    sizes, rss = [], []
    mapping = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line: its address range
                mapping = f"lamina-shm-{name} " in line
            elif mapping and line.startswith(("Size:", "Rss:")):
                (sizes if line.startswith("Size:") else rss).append(int(line.split()[1]))
    return sizes, rss


async def test_both_ends_of_a_shm_connection_map_its_rings_populated():
    # A page first touched by a frame would fault in each process that touches it.
    address = address_for("shm")
    listener, conn = await pair(address)
    async with listener, conn:
        await conn.send(Frame(1, {}, [b"x"]))
        await conn.recv()
        sizes, rss = _shm_mappings(address.removeprefix("shm://"))
        assert len(sizes) == 2 and rss == sizes, (sizes, rss)


async def test_server_killed_while_client_waits(scheme):
    proc = _spawn("server", address_for(scheme))
    try:
        address = await _readline(proc)
        conn = await transports.connect(address)
        await conn.send(Frame(1, {}, [torch.ones(3)]))
        waiting = asyncio.create_task(conn.recv())
        await asyncio.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerClosed):
            await asyncio.wait_for(waiting, 10)
        assert time.monotonic() - t0 < 5
        await conn.close()
    finally:
        proc.kill()
        proc.wait()


async def test_clean_shutdown_leaks_nothing(scheme, address):
    async def round_trip():
        blocked = asyncio.Event()

        async def handler(conn):
            await conn.send(await conn.recv())
            blocked.set()
            await conn.recv()  # cancelled by listener.close()

        listener = await transports.listen(address_for(scheme), handler)
        conn = await transports.connect(listener.address)
        await conn.send(Frame(1, {}, [torch.ones(8)]))
        await conn.recv()
        await blocked.wait()
        await listener.close()
        with pytest.raises(PeerClosed):
            await conn.recv(timeout=10)
        await conn.close()
        await conn.close()  # idempotent

    await round_trip()  # first use may open a library's process-wide resources (UCX)
    await asyncio.sleep(0.05)
    fds = open_fds()
    for _ in range(3):
        await round_trip()
    await asyncio.sleep(0.05)
    assert transport_tasks() == []
    assert open_fds() <= fds, f"fds leaked: {fds} -> {open_fds()}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch finds none here)")
async def test_cuda_tensors_arrive_whole(scheme, address):
    """A frame with CUDA tensors: staged through pinned host memory by a transport of host
    memory (the receiver gets CPU tensors), carried on the GPU by cuda_ipc, and by ucx where
    UCX sends device memory; the same values either way, frame after frame through the
    reused buffers."""
    listener, conn = await pair(address)
    async with listener, conn:
        base = torch.randn(1000, 33, device="cuda").bfloat16()
        for i in range(4):
            sent = [base * i, torch.arange(4), torch.tensor([i], device="cuda")]
            await conn.send(Frame(1, {"i": i}, sent))
            got = await conn.recv()
            assert got.header == {"i": i}
            for g, s in zip(got.tensors, sent):
                assert g.is_cuda == (s.is_cuda and not conn.stages_cuda)
                assert g.dtype == s.dtype and torch.equal(g.cpu(), s.cpu())
