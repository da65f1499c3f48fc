import pytest
import torch

from lamina.kvstore.eviction import BlockStats, make_policy
from lamina.kvstore.quant import dequantize_4bit, quantize_4bit
from lamina.services.scheduler.scheduling_policies import (
    SCHEDULING_POLICIES,
    QueuedRequest,
    fastest_prefix_first,
    fcfs,
    relaxed_fpf,
    relaxed_priority,
)


@pytest.mark.parametrize("group_size", [16, 64, 128])
def test_4bit_error_bounded_by_half_a_step_per_group(group_size):
    x = torch.randn(3, 2, 37, 3, 8) * 3  # numel not a multiple of the group size
    q = quantize_4bit(x, group_size)
    y = dequantize_4bit(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    flat = x.reshape(-1)
    n = flat.numel()
    pad = (-n) % group_size
    groups = torch.cat([flat, flat[-1:].expand(pad)]).view(-1, group_size)
    step = (groups.max(1).values - groups.min(1).values) / 15
    bound = (step / 2 + 1e-5).repeat_interleave(group_size)[:n]
    assert torch.all((y.reshape(-1) - flat).abs() <= bound)
    # 4 bits per value plus two float32 per group
    assert q.nbytes == (n + pad) // 2 + 8 * ((n + pad) // group_size)
    assert q.nbytes * 3 < x.numel() * 4  # at least 3x smaller than float32


def test_4bit_constant_groups_exact():
    x = torch.full((64,), 2.5)
    assert torch.equal(dequantize_4bit(quantize_4bit(x, 32)), x)
    with pytest.raises(ValueError):
        quantize_4bit(x, 3)


def stats(h, inserted, last):
    return BlockStats(h, inserted, last, 10)


def test_eviction_policies():
    cands = [stats("a", 1, 9), stats("b", 2, 3), stats("c", 3, 5)]
    assert make_policy("lru")(cands) == "b"
    assert make_policy("fifo")(cands) == "a"
    r1, r2 = make_policy("random", seed=7), make_policy("random", seed=7)
    picks = [r1(cands) for _ in range(20)]
    assert picks == [r2(cands) for _ in range(20)]  # seeded, reproducible
    assert set(picks) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("mru")


def q(rid, t, d):
    return QueuedRequest(rid, t, d)


def test_scheduling_policies():
    queue = [q("miss-old", 0.0, 3), q("disk", 1.0, 2), q("dev-new", 9.0, 0), q("host", 5.0, 1)]
    now = 10.0
    assert [r.request_id for r in fcfs(queue, now)] == ["miss-old", "disk", "host", "dev-new"]
    assert [r.request_id for r in fastest_prefix_first(queue, now)] == [
        "dev-new", "host", "disk", "miss-old"]
    # priorities: miss-old 10*1=10, disk 9*2=18, dev-new 1*4=4, host 5*3=15
    assert relaxed_priority(queue[1], now) == 18.0
    assert [r.request_id for r in relaxed_fpf(queue, now)] == [
        "disk", "host", "miss-old", "dev-new"]
    # waiting long enough, an uncached request overtakes a device hit
    assert relaxed_fpf([q("dev", 99.0, 0), q("miss", 50.0, 3)], 100.0)[0].request_id == "miss"
    assert set(SCHEDULING_POLICIES) == {"fcfs", "fpf", "relaxed_fpf"}
    with pytest.raises(ValueError):
        QueuedRequest("x", 0.0, 4)
