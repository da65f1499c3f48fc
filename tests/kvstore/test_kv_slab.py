import pytest
import torch

from lamina.kvstore.slab import KVAllocationError, SlabAllocator, SlabConfig

H, D = 2, 4


def make(num_slabs: int = 2, tokens_per_slab: int = 4, num_layers: int = 2) -> SlabAllocator:
    per_token = num_layers * 2 * H * D * 4
    cfg = SlabConfig(num_layers=num_layers, num_kv_heads=H, head_dim=D,
                     capacity_bytes=num_slabs * tokens_per_slab * per_token + 7,
                     tokens_per_slab=tokens_per_slab)
    return SlabAllocator(cfg)


def test_capacity_from_bytes_and_validation():
    a = make(num_slabs=3)
    assert a.config.bytes_per_token == 2 * 2 * H * D * 4
    assert a.num_total_tokens == 12 and a.config.num_slabs == 3
    assert a.k_pools[0].shape == (12, H, D) and len(a.v_pools) == 2
    with pytest.raises(ValueError, match="holds no slab"):
        SlabConfig(num_layers=1, num_kv_heads=1, head_dim=1, capacity_bytes=10,
                   tokens_per_slab=4)


def test_exact_slots_slabs_open_lazily():
    a = make()
    assert a.num_open_slabs == 0 and a.fragmentation == 0.0
    assert a.allocate("r1", 3) == [0, 1, 2]
    assert a.num_open_slabs == 1
    assert a.allocate("r2", 3) == [3, 4, 5]  # crosses into slab 1
    assert a.num_open_slabs == 2
    assert a.slab_ranges("r2") == [(3, 6)]
    assert a.num_used_tokens == 6 and a.occupancy == 6 / 8
    assert a.fragmentation == 2 / 8


def test_lifo_reuse_order():
    a = make()
    a.allocate("r1", 3)  # 0 1 2
    a.allocate("r2", 2)  # 3 4
    assert a.free("r1") == 3
    # r1's slots come back first, in position order (LIFO: most recently freed on top).
    assert a.allocate("r3", 2) == [0, 1]
    a.free("r2")
    assert a.allocate("r4", 4) == [3, 4, 2, 5]
    assert a.slab_ranges("r4") == [(3, 5), (2, 3), (5, 6)]


def test_failure_is_clear_and_changes_nothing():
    a = make()
    a.allocate("r1", 6)
    assert a.can_allocate(2) and not a.can_allocate(3)
    with pytest.raises(KVAllocationError) as e:
        a.allocate("r2", 3)
    assert e.value.num_requested == 3 and e.value.num_available == 2
    assert not a.has_request("r2") and a.num_free_tokens == 2
    with pytest.raises(KVAllocationError):
        a.extend("r1", 3)
    assert a.num_tokens("r1") == 6
    assert a.extend("r1", 2) == [6, 7]


def test_fork_shares_and_refcounts():
    a = make()
    a.allocate("p", 4)
    assert a.fork("p", "c", 3) == [0, 1, 2]
    assert [a.refcount(s) for s in range(4)] == [2, 2, 2, 1]
    assert a.extend("c") == [4]
    assert a.free("p") == 1  # only slot 3 was exclusive
    assert [a.refcount(s) for s in range(5)] == [1, 1, 1, 0, 1]
    assert a.free("c") == 4
    assert a.num_used_tokens == 0


def test_copy_on_write_keeps_the_sharer_intact():
    a = make()
    a.allocate("p", 3)
    for layer in range(2):
        a.write("p", layer, 0, torch.full((3, H, D), float(layer + 1)),
                torch.full((3, H, D), -float(layer + 1)))
    a.fork("p", "c", 3)
    new_k = torch.full((1, H, D), 9.0)
    a.write("c", 1, 2, new_k, -new_k)  # position 2 is shared: copied first
    assert a.slots("c") == [0, 1, 3] and a.slots("p") == [0, 1, 2]
    assert a.refcount(2) == 1 and a.refcount(3) == 1
    k_p, _ = a.read("p", 1)
    k_c, v_c = a.read("c", 1)
    assert torch.equal(k_p[2], torch.full((H, D), 2.0))
    assert torch.equal(k_c[2], torch.full((H, D), 9.0)) and torch.equal(v_c[2], -k_c[2])
    # the copy carried the other layer too
    k_c0, _ = a.read("c", 0)
    assert torch.equal(k_c0, torch.full((3, H, D), 1.0))


def test_copy_on_write_failure_changes_nothing():
    a = make(num_slabs=1)
    a.allocate("p", 4)
    a.fork("p", "c", 4)
    a.free("p")
    a.allocate("x", 0)
    a.fork("c", "d", 4)
    with pytest.raises(KVAllocationError):
        a.prepare_write("d", 0, 1)
    assert a.slots("d") == [0, 1, 2, 3] and a.refcount(0) == 2


@pytest.mark.parametrize("end", ["free", "abort"])
def test_every_token_freed_when_requests_end_or_abort(end):
    a = make(num_slabs=4)
    a.allocate("p", 5)
    a.fork("p", "c1", 5)
    a.fork("p", "c2", 2)
    a.extend("c1", 3)
    a.write("c2", 0, 1, torch.zeros(1, H, D), torch.zeros(1, H, D))
    for rid in ("p", "c1", "c2"):
        getattr(a, end)(rid)
    assert a.num_used_tokens == 0 and a.num_requests == 0
    assert all(a.refcount(s) == 0 for s in range(a.num_total_tokens))
    assert a.abort("p") == 0  # aborting an ended request is harmless
    assert a.fragmentation == 1.0 and a.occupancy == 0.0


def test_batch_slots_concatenate_each_request_in_position_order():
    a = make(num_slabs=4)
    a.allocate("p", 3)
    a.allocate("q", 2)
    a.extend("p", 2)
    a.allocate("empty", 0)
    slots = a.batch_slots(["q", "empty", "p"])
    assert slots.dtype == torch.int64 and slots.tolist() == a.slots("q") + a.slots("p")
    assert a.batch_slots([]).shape == (0,)
    assert torch.equal(a.slot_tensor("p"), torch.tensor(a.slots("p")))
    slots[0] = 99  # a copy: the allocator's lists are untouched
    assert a.slots("q")[0] != 99


def test_slot_version_changes_exactly_when_the_slots_do():
    a = make(num_slabs=4)
    a.allocate("p", 3)
    v0 = a.slot_version("p")
    a.write("p", 0, 0, torch.zeros(3, H, D), torch.zeros(3, H, D))  # exclusive slots: written in place
    assert a.slot_version("p") == v0
    a.fork("p", "c", 3)
    assert a.slot_version("p") == v0  # sharing does not move the source's slots
    v_c = a.slot_version("c")
    a.extend("c")
    assert a.slot_version("c") != v_c
    v_c = a.slot_version("c")
    a.write("c", 0, 1, torch.ones(1, H, D), torch.ones(1, H, D))  # copy-on-write moves position 1
    assert a.slot_version("c") != v_c
    stamps = {a.slot_version("p"), a.slot_version("c")}
    a.free("c")
    a.allocate("c", 4)  # the same id and length again: a new version all the same
    assert a.slot_version("c") not in stamps


def test_choices_share_a_prompt_across_a_partly_filled_slab():
    """n = 3 choices of a 6-token prompt (one full slab of 4, two tokens of the next):
    every prompt slot is shared, none copied; each choice appends to fresh slots."""
    a = make(num_slabs=4)
    assert a.allocate("r/0", 6) == [0, 1, 2, 3, 4, 5]
    for child in ("r/1", "r/2"):
        assert a.fork("r/0", child, 6) == [0, 1, 2, 3, 4, 5]
    assert [a.refcount(s) for s in range(7)] == [3] * 6 + [0]
    assert a.num_used_tokens == 6 and a.num_sequence_tokens == 18
    # Decode: each choice's next token gets its own slot, the shared slab's tail first.
    assert [a.extend(r)[0] for r in ("r/0", "r/1", "r/2")] == [6, 7, 8]
    assert a.slots("r/1") == [0, 1, 2, 3, 4, 5, 7]
    assert a.num_used_tokens == 9 and a.num_sequence_tokens == 21
    a.prepare_write("r/2", 6, 1)  # its own slot: nothing to copy
    assert a.slots("r/2")[6] == 8 and a.num_used_tokens == 9
    # Choices end in any order; the prompt goes back with the last of them.
    assert a.free("r/0") == 1 and [a.refcount(s) for s in range(6)] == [2] * 6
    assert a.free("r/2") == 1
    assert a.free("r/1") == 7 and a.num_used_tokens == 0 and a.num_sequence_tokens == 0
