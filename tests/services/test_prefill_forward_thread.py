"""A prefill forward on its own thread (lamina.services.prefill.forward_thread): the event
loop stays free while it computes, each layer is handed to the loop in order, and a
failed send, a failed layer or a cancelled caller stops it at a layer boundary."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from lamina.model.attention import attention_with_lse
from lamina.model.llama import split_llama
from lamina.services.prefill import forward_thread
from lamina.services.prefill.forward_thread import ForwardThread

WAIT_S = 30.0  # a bound on waits that end at once when the code is right (they fail instead of hanging)


@pytest.fixture(scope="module")
def split(loaded_model):
    return split_llama(loaded_model.model, example_tokens=8)


@pytest.fixture
def inputs(loaded_model):
    ids = torch.tensor(loaded_model.tokenizer.encode("A forward that leaves its event loop free"))
    return {"input_ids": ids, "positions": torch.arange(len(ids)), "logits_index": torch.arange(len(ids))}


def dense(i, q, k, v):
    return attention_with_lse(q, k, v)[0]


@pytest.fixture
def forwards():
    thread = ForwardThread(torch.device("cpu"))
    yield thread
    thread.close(wait=True)


def test_the_loop_runs_while_a_layer_computes_and_gets_each_layer_in_order(split, inputs, forwards):
    """Layer 0's attention waits for an event that only a task of the loop sets: on the
    loop, the forward would never end (the wait fails after WAIT_S). The output equals the
    synchronous run's; each layer reaches `on_layer` on the loop, in order, after its
    attention ran on the other thread under inference mode."""
    with torch.inference_mode():
        expected = split.run(inputs, dense)
    loop_free = threading.Event()
    attended: list[tuple[int, bool, bool]] = []  # layer, on the loop's thread, in inference mode
    handed: list[tuple[int, bool]] = []

    def attend(i, q, k, v):
        if i == 0:
            assert loop_free.wait(WAIT_S), "the loop did not run while the forward computed"
        attended.append((i, threading.get_ident() == loop_thread, torch.is_inference_mode_enabled()))
        return dense(i, q, k, v)

    async def on_layer(i: int) -> None:
        handed.append((i, threading.get_ident() == loop_thread))
        await asyncio.sleep(0)

    async def main():
        nonlocal loop_thread
        loop_thread = threading.get_ident()
        asyncio.get_running_loop().call_soon(loop_free.set)
        return await forwards.run(split, inputs, attend, on_layer)

    loop_thread = 0
    got = asyncio.run(main())
    assert torch.equal(got, expected)
    layers = list(range(split.num_attention))
    assert attended == [(i, False, True) for i in layers]
    assert handed == [(i, True) for i in layers]


def test_a_failed_send_stops_the_forward_at_its_next_layer_and_is_raised(split, inputs, forwards, monkeypatch):
    """Layer 2's send fails while layer 3 computes (its attention waits until the forward
    was asked to stop): layer 4 never starts, and the send's error is raised."""
    stops: list[threading.Event] = []

    def recorded_event() -> threading.Event:
        stops.append(threading.Event())
        return stops[-1]

    monkeypatch.setattr(forward_thread, "threading", SimpleNamespace(Event=recorded_event))
    attended: list[int] = []
    in_layer_3 = threading.Event()

    def attend(i, q, k, v):
        if i == 3:
            in_layer_3.set()
            assert stops[-1].wait(WAIT_S), "the failed send did not stop the forward"
        attended.append(i)
        return dense(i, q, k, v)

    async def on_layer(i: int) -> None:
        if i == 2:
            assert await asyncio.to_thread(in_layer_3.wait, WAIT_S)
            raise ConnectionResetError("an attention worker went away")

    with pytest.raises(ConnectionResetError, match="went away"):
        asyncio.run(forwards.run(split, inputs, attend, on_layer))
    assert attended == [0, 1, 2, 3]


def test_a_failed_forward_lets_the_send_in_progress_end_whole(split, inputs, forwards):
    """Layer 1's attention fails while layer 0's send is in progress: that send ends whole
    (cut short, a frame would take its connection down), no later layer is sent, and
    the forward's error is raised."""
    sending_0 = threading.Event()
    failed = threading.Event()
    begun: list[int] = []
    ended: list[int] = []

    def attend(i, q, k, v):
        if i == 1:
            assert sending_0.wait(WAIT_S)
            failed.set()
            raise RuntimeError("attention failed")
        return dense(i, q, k, v)

    async def on_layer(i: int) -> None:
        begun.append(i)
        sending_0.set()
        assert await asyncio.to_thread(failed.wait, WAIT_S)
        await asyncio.sleep(0.1)  # the failure reaches the loop meanwhile
        ended.append(i)

    async def main():
        with pytest.raises(RuntimeError, match="attention failed"):
            await forwards.run(split, inputs, attend, on_layer)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []
    assert begun == ended == [0]


def test_a_cancelled_forward_stops_at_its_next_layer(split, inputs, forwards):
    """The caller goes away while layer 1 computes: the thread cannot be interrupted
    there, but it computes no layer after it, and the next forward runs as usual."""
    attended: list[int] = []
    in_layer_1 = threading.Event()
    cancelled = threading.Event()

    def attend(i, q, k, v):
        if i == 1:
            in_layer_1.set()
            assert cancelled.wait(WAIT_S)
        attended.append(i)
        return dense(i, q, k, v)

    async def on_layer(i: int) -> None:
        pass

    async def main():
        task = asyncio.create_task(forwards.run(split, inputs, attend, on_layer))
        assert await asyncio.to_thread(in_layer_1.wait, WAIT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        cancelled.set()
        # The next forward waits for the stopped one to leave the thread, then runs whole.
        return await forwards.run(split, inputs, dense, on_layer)

    with torch.inference_mode():
        expected = split.run(inputs, dense)
    assert torch.equal(asyncio.run(main()), expected)
    assert attended == [0, 1]



def test_a_forward_after_close_is_refused_and_leaves_no_task(split, inputs):
    forwards = ForwardThread(torch.device("cpu"))
    forwards.close(wait=True)

    async def on_layer(i: int) -> None:
        pass

    async def main():
        with pytest.raises(RuntimeError, match="shutdown"):
            await forwards.run(split, inputs, dense, on_layer)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []
