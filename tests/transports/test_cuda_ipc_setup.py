"""cuda_ipc's setup decisions that need no GPU (transports/cuda_ipc.py): where a ring is
allocated, how a peer's GPU and process are recognised, and when the transport refuses.
The rings themselves are exercised on a GPU (test_cuda_ipc.py, the conformance suite)."""

from __future__ import annotations

import os

import pytest
import torch

from lamina.transports import TransportError, cuda_ipc


@pytest.mark.parametrize(("conf", "toggled"), [
    ({}, []),
    ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}, []),
    ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, ["expandable_segments:False",
                                                              "expandable_segments:True"]),
    ({"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.6, expandable_segments: true"},
     ["expandable_segments:False", "expandable_segments:True"]),
])
def test_a_ring_is_allocated_outside_expandable_segments(monkeypatch, conf, toggled):
    """Expandable segments, which CUDA IPC cannot export between unrelated processes, are
    off for the ring's allocation alone, and on again after it."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in conf.items():
        monkeypatch.setenv(name, value)
    made: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", made.append)
    ring = cuda_ipc._ipc_exportable(4096, torch.device("cpu"))  # the device does not matter to the choice
    assert ring.numel() == 4096 and ring.dtype == torch.uint8
    assert made == toggled


def test_the_peers_gpu_is_found_by_its_uuid(monkeypatch):
    """Another process may see the GPUs under other indices (CUDA_VISIBLE_DEVICES): its
    ring's GPU is named by UUID, and one this process does not see is refused by name."""
    uuids = ["GPU-aaaa", "GPU-bbbb"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(uuids))
    monkeypatch.setattr(cuda_ipc, "_device_uuid", lambda index: uuids[index])
    assert cuda_ipc._local_device({"device_uuid": "GPU-bbbb"}) == torch.device("cuda", 1)
    with pytest.raises(TransportError, match="GPU-cccc, which this process does not see"):
        cuda_ipc._local_device({"device_uuid": "GPU-cccc"})


def test_a_peer_with_this_pid_in_another_pid_namespace_is_another_process(monkeypatch):
    """The same pid with another process id is a peer elsewhere (pid namespaces): its ring
    is mapped by handle, not looked up among this process's own."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    theirs = {"pid": os.getpid(), "process": "another", "token": "t", "device_uuid": "GPU-x", "ring": []}
    with pytest.raises(TransportError, match="GPU-x, which this process does not see"):
        cuda_ipc._mapped(theirs)
    with pytest.raises(TransportError, match="the peer's ring is gone"):
        cuda_ipc._mapped({**theirs, "process": cuda_ipc._PROCESS})  # this process's: no such token


def test_the_peers_events_a_host_ordered_peer_has_none_and_one_in_this_process_shares_its_own():
    """A device-ordered peer's setup names its interprocess events: none for a
    host-ordered one, this process's own objects for a peer here (a process cannot open
    its own IPC handles), and anything but handles is refused."""
    here = {"pid": os.getpid(), "process": cuda_ipc._PROCESS, "token": "t-events", "device_uuid": "GPU-x"}
    assert cuda_ipc._mapped_events({**here, "events": []}) == []
    assert cuda_ipc._mapped_events(here) == []  # a setup without the key: host-ordered
    with pytest.raises(TransportError, match="not IPC handles"):
        cuda_ipc._mapped_events({**here, "events": ["not bytes"]})
    with pytest.raises(TransportError, match="the peer's events are gone"):
        cuda_ipc._mapped_events({**here, "events": [b"h"]})

    class Exported:  # what _LOCAL holds: the sending end's ring and events
        def __init__(self) -> None:
            self.events = ["event 0", "event 1"]

    exported = Exported()
    cuda_ipc._LOCAL["t-events"] = exported
    try:
        assert cuda_ipc._mapped_events({**here, "events": [b"h0", b"h1"]}) == ["event 0", "event 1"]
    finally:
        cuda_ipc._LOCAL.pop("t-events", None)


def test_the_async_allocator_is_refused_before_any_connection(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    assert "cudaMallocAsync" in cuda_ipc.CudaIpcTransport.availability()
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    assert cuda_ipc.CudaIpcTransport.availability() is None
