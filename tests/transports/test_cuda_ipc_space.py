"""The sending end's account of its cuda_ipc ring (transports/cuda_ipc.py `_Space`): where
each frame's tensors go, when a frame waits for the receiver to free space, and that a
connection's end wakes a waiting sender with an error; and a receiving end's check of its
device-ordered frames' seals (`_Seals`). Pure bookkeeping: no GPU needed."""

from __future__ import annotations

import asyncio
from collections import deque

import pytest
import torch

from lamina.transports import PeerClosed, cuda_ipc
from lamina.transports.cuda_ipc import _ALIGN, _Space


async def test_tensors_are_placed_aligned_one_after_another_and_a_run_never_wraps():
    space = _Space(4096)
    assert await space.take([10, 300]) == [0, _ALIGN]  # 10 bytes take one aligned unit
    assert space.head == 3 * _ALIGN
    space.free(space.head)  # the receiver copied them out
    # 3,500 bytes from offset 768 would cross the end: the run starts over at 0, the
    # skipped end free at once (everything before it was freed).
    assert await asyncio.wait_for(space.take([3500]), 1) == [0]
    assert space.head == 4096 + 14 * _ALIGN


async def test_a_run_that_would_wrap_waits_for_the_frames_before_the_skipped_end():
    space = _Space(4096)
    await space.take([1024])  # outstanding
    await space.take([1024])
    waiting = asyncio.ensure_future(space.take([3000]))  # from 2,048 it would cross the end
    await asyncio.sleep(0.01)
    assert not waiting.done()
    space.free(1024)
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the second frame still holds [1024, 2048)
    space.free(2048)
    assert await asyncio.wait_for(waiting, 1) == [0]


async def test_a_frame_waits_until_the_receiver_frees_enough():
    space = _Space(4096)
    await space.take([4096])
    waiting = asyncio.ensure_future(space.take([1024]))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the ring is full
    space.free(1024)  # only the first kilobyte back: enough
    assert await asyncio.wait_for(waiting, 1) == [0]
    space.free(512)  # an older count changes nothing
    assert space.freed == 1024


async def test_a_sender_waiting_for_space_raises_when_the_connection_ends():
    space = _Space(4096)
    await space.take([4096])
    waiting = asyncio.ensure_future(space.take([1]))
    await asyncio.sleep(0.01)
    space.fail(PeerClosed("connection to x ended"))
    with pytest.raises(PeerClosed, match="ended"):
        await asyncio.wait_for(waiting, 1)


async def test_a_device_ordered_sender_waits_until_the_frame_its_event_last_marked_is_freed():
    """With max_frames (a device-ordered sender's events), frame n takes event n % max_frames:
    it waits until the receiver freed frame n - max_frames, whose copies out were queued
    after a wait on that event's earlier record, whatever the ring's space."""
    space = _Space(1 << 20, max_frames=2)
    await space.take([256])
    await space.take([256])
    assert space.frames == 2
    waiting = asyncio.ensure_future(space.take([256]))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # space enough, but both events are out
    space.free(256)  # bytes alone, as a host-ordered receiver's older count: still out
    await asyncio.sleep(0.01)
    assert not waiting.done()
    space.free(256, frames=1)
    assert await asyncio.wait_for(waiting, 1) == [512]
    assert space.frames == 3 and space.frames_freed == 1
    space.free(0, frames=0)  # an older count changes nothing
    assert space.freed == 256 and space.frames_freed == 1


async def test_a_closing_sender_can_wait_until_the_receiver_freed_every_frame():
    space = _Space(1 << 20, max_frames=4)
    await space.take([256])
    await space.take([256])
    space.fail(PeerClosed("closing"))  # as close() does first: no more sends
    drained = asyncio.ensure_future(space.drained())
    await asyncio.sleep(0.01)
    space.free(256, frames=1)
    await asyncio.sleep(0.01)
    assert not drained.done()
    space.free(512, frames=2)
    await asyncio.wait_for(drained, 1)


async def test_without_max_frames_only_space_bounds_the_frames_out():
    space = _Space(1 << 20)
    for _ in range(100):
        await asyncio.wait_for(space.take([256]), 1)
    assert space.frames == 100 and space.frames_freed == 0


class _Done:
    """Stands in for a frame's copies-done event."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _seals(slots: int, salt: int) -> cuda_ipc._Seals:
    """A receiving end's seals with host memory for the copies (pinned memory needs a GPU)."""
    seals = object.__new__(cuda_ipc._Seals)
    seals.copies, seals.salt, seals.peer, seals.pending, seals.ended = (
        torch.zeros(slots, dtype=torch.int64), salt, "peer", deque(), False)
    return seals


def test_a_frame_whose_seal_is_not_its_own_is_torn_and_each_is_checked_once_its_copies_are_done(monkeypatch):
    """Each device-ordered frame is checked when its copies out are done, in order: its
    seal copy must be seal_of(salt, its number); an older one (its sender never wrote it)
    is counted torn. torn_frames() checks every receiving end, and forgets an ended one
    once its last frame is checked."""
    tally = cuda_ipc._Tally()
    monkeypatch.setattr(cuda_ipc, "_TALLY", tally)
    salt = (1 << 62) - 3  # wraps: seal_of stays in 62 bits
    seals = _seals(4, salt)
    tally.seals.append(seals)
    first, second, third = _Done(True), _Done(True), _Done(False)
    seals.expect(first, 0, 0)
    seals.copies[0] = cuda_ipc.seal_of(salt, 0)  # written whole
    seals.expect(second, 1, 1)
    seals.copies[1] = cuda_ipc.seal_of(salt, 1 - 4)  # what the frame 4 before left in the ring
    seals.expect(third, 2, 2)
    assert cuda_ipc.seal_of(salt, 3) == 0 and cuda_ipc.seal_of(salt, 1) == (1 << 62) - 2
    assert cuda_ipc.torn_frames() == 1  # the second; the third's copies are not done
    assert len(seals.pending) == 1
    seals.ended = True
    seals.copies[2] = cuda_ipc.seal_of(salt, 2)
    third.done = True
    assert cuda_ipc.torn_frames() == 1 and tally.seals == []  # checked, then forgotten
