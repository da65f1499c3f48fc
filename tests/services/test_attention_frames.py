"""The attention worker's answer to frames that pass the transport's checksums but not
its own: an ERROR frame with a code, and no change to any sequence's KV."""

from __future__ import annotations

import pytest
import torch

from lamina.model.attention import batched_attention
from lamina.services.attention.attention_service import AttentionService
from lamina.services.config import AttentionSection, StackConfig
from lamina.services.wire import Attend, Kind, StoreKV, decode_tag
from lamina.transports import Frame

L, HQ, HKV, D = 30, 9, 3, 64  # the default model (SmolLM2-135M): every worker holds all KV heads


@pytest.fixture(scope="module")
def service() -> AttentionService:
    # Redis is never reached: only the frame handling is exercised.
    config = StackConfig(redis_url="redis://127.0.0.1:1", attention=AttentionSection(workers=1,
                                                                                   kv_capacity_bytes=16 << 20))
    return AttentionService(config)


def _store(service: AttentionService, seq: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv = [(torch.randn(n, HKV, D), torch.randn(n, HKV, D)) for _ in range(L)]
    replies = [service._handle(StoreKV(seq, layer, L, k, v).to_frame(), {}) for layer, (k, v) in enumerate(kv)]
    assert replies[:-1] == [None] * (L - 1) and replies[-1].kind == Kind.ACK
    return kv


def _snapshot(service: AttentionService) -> dict:
    slabs = service.core.slabs
    state = {"used": service.core.used_bytes}
    for s in list(slabs._seqs):
        state[s] = [torch.cat(slabs.read(s, layer)).clone() for layer in range(L)]
    return state


def _assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys() and before["used"] == after["used"]
    for s in before:
        if s != "used":
            assert all(torch.equal(a, b) for a, b in zip(before[s], after[s])), f"KV of {s} changed"


def _attend(layer, seqs, q, k, v, kind=Kind.ATTEND, tag=(0, 0, 0)) -> Frame:
    return Attend(kind, tag, layer, seqs, q, k, v).to_frame()


def _with_header(frame: Frame, **changes) -> Frame:
    header = {**frame.header, **changes}
    for name, value in changes.items():
        if value is ...:
            del header[name]
    return Frame(frame.kind, header, frame.tensors)


def _hostile_frames() -> list[tuple[str, Frame, str]]:
    """(what, frame, the code of its ERROR reply); "a" holds 4 tokens."""
    q, k, v = torch.randn(1, HQ, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    ok = _attend(0, [("a", 1)], q, k, v)
    store = StoreKV("b", 0, L, torch.randn(2, HKV, D), torch.randn(2, HKV, D)).to_frame()
    return [
        ("layer out of range", _attend(L, [("a", 1)], q, k, v), "bad_request"),
        ("negative layer", _attend(-1, [("a", 1)], q, k, v), "bad_request"),
        ("more new tokens than held", _attend(1, [("a", 6)], *(torch.randn(6, h, D) for h in (HQ, HKV, HKV))),
         "bad_request"),
        ("rows do not match the tensors", _attend(0, [("a", 2)], q, k, v), "bad_request"),
        ("no new tokens", _attend(0, [("a", 0)], q[:0], k[:0], v[:0]), "bad_request"),
        ("no sequences", _attend(0, [], q[:0], k[:0], v[:0]), "bad_request"),
        ("a sequence twice", _attend(0, [("a", 1), ("a", 1)], *(torch.cat([t, t]) for t in (q, k, v))),
         "bad_request"),
        ("the model's query heads for a share", _attend(0, [("a", 1)], torch.randn(1, HQ + 1, D), k, v),
         "bad_request"),
        ("wrong KV heads", _attend(0, [("a", 1)], q, torch.randn(1, 1, D), torch.randn(1, 1, D)), "bad_request"),
        ("wrong head dim", _attend(0, [("a", 1)], torch.randn(1, HQ, 32), k, v), "bad_request"),
        ("float64", _attend(0, [("a", 1)], q.double(), k, v), "bad_request"),
        ("int K", _attend(0, [("a", 1)], q, k.int(), v), "bad_request"),
        ("2-D q", _attend(0, [("a", 1)], q[0], k, v), "bad_request"),
        ("raw bytes for a tensor", Frame(Kind.ATTEND, ok.header, [b"\0" * 16, k, v]), "bad_request"),
        ("two tensors for three", Frame(Kind.ATTEND, ok.header, [q, k]), "bad_request"),
        ("unknown sequence", _attend(0, [("ghost", 1)], q, k, v), "unknown_sequence"),
        ("unknown kind", Frame(99, ok.header, ok.tensors), "protocol"),
        ("a reply kind", Frame(Kind.RESULT, ok.header, [q]), "protocol"),
        ("no tag", _with_header(ok, tag=...), "protocol"),
        ("a tag of maps", _with_header(ok, tag=[{"x": 1}]), "protocol"),
        ("empty tag", _with_header(ok, tag=[]), "protocol"),
        ("header not a map", Frame(Kind.ATTEND, [1, 2, 3], ok.tensors), "protocol"),
        ("no layer", _with_header(ok, layer=...), "bad_request"),
        ("layer a string", _with_header(ok, layer="0"), "bad_request"),
        ("layer a float", _with_header(ok, layer=0.0), "bad_request"),
        ("layer a boolean", _with_header(ok, layer=False), "bad_request"),
        ("seqs a map", _with_header(ok, seqs={"a": 1}), "bad_request"),
        ("seq id an integer", _with_header(ok, seqs=[[7, 1]]), "bad_request"),
        ("count a string", _with_header(ok, seqs=[["a", "1"]]), "bad_request"),
        ("a triple", _with_header(ok, seqs=[["a", 1, 2]]), "bad_request"),
        ("ATTEND_KV without its Q", _attend(0, [("a", 1)], None, k, v, Kind.ATTEND_KV), "protocol"),
        ("STORE_KV K and V differ", Frame(Kind.STORE_KV, store.header, [store.tensors[0], torch.randn(3, HKV, D)]),
         "bad_request"),
        ("STORE_KV wrong heads", Frame(Kind.STORE_KV, store.header, [torch.randn(2, 1, D)] * 2), "bad_request"),
        ("STORE_KV float64", Frame(Kind.STORE_KV, store.header, [t.double() for t in store.tensors]),
         "bad_request"),
        ("STORE_KV layer out of range", _with_header(store, layer=L + 3), "bad_request"),
        ("STORE_KV other layer count", _with_header(store, num_layers=L + 1), "bad_request"),
        ("STORE_KV seq id a list", _with_header(store, seq_id=["b"]), "bad_request"),
        ("STORE_KV no seq id", _with_header(store, seq_id=...), "bad_request"),
        ("STORE_KV layer without layer 0", _with_header(store, layer=5), "unknown_sequence"),
        ("STORE_KV one tensor", Frame(Kind.STORE_KV, store.header, store.tensors[:1]), "bad_request"),
    ]


def test_hostile_frames_get_an_error_and_change_nothing(service):
    torch.manual_seed(0)
    kv = _store(service, "a", 4)
    before = _snapshot(service)
    for what, frame, code in _hostile_frames():
        reply = service._handle(frame, {})
        assert reply is not None and reply.kind == Kind.ERROR, what
        assert reply.header["code"] == code, (what, reply.header)
        _assert_same(before, _snapshot(service))
    # The sequence decodes as if nothing had come between.
    q, k, v = torch.randn(1, HQ, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    reply = service._handle(_attend(0, [("a", 1)], q, k, v), {})
    assert reply.kind == Kind.RESULT
    ref, _ = batched_attention(q, [1], [torch.cat([kv[0][0], k])], [torch.cat([kv[0][1], v])])
    torch.testing.assert_close(reply.tensors[0], ref)
    service.core.free(["a"])


def test_a_failed_q_early_half_appends_nothing(service):
    torch.manual_seed(1)
    kv = _store(service, "a", 4)
    _store(service, "c", 2)
    held: dict = {}
    q, k, v = torch.randn(1, HQ, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    tag = decode_tag(0, 1, 0)
    assert service._handle(_attend(0, [("a", 1)], q, None, None, Kind.ATTEND_Q, tag), held) is None
    before = _snapshot(service)
    # K, V naming another sequence than its Q: refused before K is appended anywhere.
    reply = service._handle(_attend(0, [("c", 1)], None, k, v, Kind.ATTEND_KV, tag), held)
    assert (reply.kind, reply.header["code"], reply.header["tag"]) == (Kind.ERROR, "protocol", list(tag))
    _assert_same(before, _snapshot(service))
    # A refused Q is answered once, when its K, V come.
    bad_q = _attend(0, [("a", 1)], torch.randn(1, HQ, 8), None, None, Kind.ATTEND_Q, tag)
    assert service._handle(bad_q, held) is None
    reply = service._handle(_attend(0, [("a", 1)], None, k, v, Kind.ATTEND_KV, tag), held)
    assert reply.header["code"] == "bad_request" and not held
    _assert_same(before, _snapshot(service))
    # The same step sent right: the two halves give plain attention's output.
    assert service._handle(_attend(0, [("a", 1)], q, None, None, Kind.ATTEND_Q, tag), held) is None
    reply = service._handle(_attend(0, [("a", 1)], None, k, v, Kind.ATTEND_KV, tag), held)
    assert reply.kind == Kind.RESULT and not held
    ref, _ = batched_attention(q, [1], [torch.cat([kv[0][0], k])], [torch.cat([kv[0][1], v])])
    torch.testing.assert_close(reply.tensors[0], ref, atol=1e-5, rtol=1e-4)
    before = _snapshot(service)
    # Too many halves waiting on one connection: refused at once.
    for i in range(64):
        assert service._handle(_attend(0, [("a", 1)], q, None, None, Kind.ATTEND_Q, (9, i, 0)), held) is None
    reply = service._handle(_attend(0, [("a", 1)], q, None, None, Kind.ATTEND_Q, (9, 99, 0)), held)
    assert reply.header["code"] == "protocol" and len(held) == 64
    service.core.free(["a", "c"])


def test_a_malformed_layer_abandons_its_store(service):
    torch.manual_seed(2)
    good = [(torch.randn(3, HKV, D), torch.randn(3, HKV, D)) for _ in range(L)]
    for layer in range(3):
        assert service._handle(StoreKV("p", layer, L, *good[layer]).to_frame(), {}) is None
    # Layer 3 carries fewer tokens than layer 0: refused now, the store's KV freed.
    reply = service._handle(StoreKV("p", 3, L, good[3][0][:2], good[3][1][:2]).to_frame(), {})
    assert reply.header["code"] == "bad_request" and reply.header["tag"] == ["p"]
    assert not service.core.slabs.has_request("p") and service.core.used_bytes == 0
    # Its later layers are dropped and the last is answered with the error.
    replies = [service._handle(StoreKV("p", layer, L, *good[layer]).to_frame(), {}) for layer in range(4, L)]
    assert replies[:-1] == [None] * (L - 5) and replies[-1].header["code"] == "bad_request"
    # Out of turn, and decoding a sequence whose store is not whole.
    assert service._handle(StoreKV("p", 0, L, *good[0]).to_frame(), {}) is None
    reply = service._handle(StoreKV("p", 2, L, *good[2]).to_frame(), {})
    assert reply.header["code"] == "protocol"
    q, k, v = torch.randn(1, HQ, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D)
    assert service._handle(_attend(0, [("p", 1)], q, k, v), {}).header["code"] == "unknown_sequence"
    service.core.free(["p"])
    assert service.core.used_bytes == 0 and not service.core._storing
    # A whole store afterwards is acknowledged.
    _store(service, "p", 3)
    service.core.free(["p"])


def test_stores_in_progress_are_bounded(service, monkeypatch):
    monkeypatch.setattr("lamina.services.attention.attention_core._MAX_PENDING_STORES", 3)
    kv = (torch.randn(1, HKV, D), torch.randn(1, HKV, D))
    for s in "xyz":
        assert service._handle(StoreKV(s, 0, L, *kv).to_frame(), {}) is None
    reply = service._handle(StoreKV("w", 0, L, *kv).to_frame(), {})
    assert reply.header["code"] == "kv_full" and not service.core.slabs.has_request("w")
    assert service._handle(StoreKV("x", 0, L, *kv).to_frame(), {}) is None  # restarting one is no new store
    service.core.free(list("xyz"))
    assert service.core.used_bytes == 0 and not service.core._storing
