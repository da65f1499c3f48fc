"""A prefill forward on a thread of its own, each finished layer handed to the event loop.

On a CPU a prompt of thousands of tokens forwards for many seconds (5,000 tokens of
SmolLM2 on two cores: about a minute). Run on the prefill worker's event loop, that
forward held everything else the loop does: its gRPC server (health probes, new prompts
and prefix-cache queries waited for it), and its registration's refresh, so the worker's
entry in the metadata store lapsed (its TTL is 10 s) and the scheduler saw it gone until
the forward ended. A turn for the loop at every layer was not enough: a gRPC call needs
several turns, and a layer of a long prompt takes seconds.

So the forward runs on one owned thread (`ForwardThread`), the whole of it, as the
synchronous `SplitModel.run`: the loop is free meanwhile (torch's kernels and the native
products release the GIL), and the layers' KV sends, which need the loop's transports,
run there as each layer's attention ends (`on_layer`, in layer order) while the later
layers compute, so sending overlaps computing instead of alternating with it. The thread
never waits for the loop; a failed send stops the forward at its next layer.

Torch's per-thread settings are the thread's own: it enters inference mode for each
forward, and on a GPU makes the service's device its current one. Both threads use the
device's default stream (nothing here sets another), so a transport's copy ordered after
the loop thread's current stream is ordered after the kernels this thread launched.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lamina.model.splitter import Attend, SplitModel
from lamina.services.devices import use_device


class ForwardStopped(Exception):
    """The forward was stopped at a layer boundary: a send of its KV failed, or its
    caller went away."""


class ForwardThread:
    """The thread a prefill worker's forwards run on, one forward at a time."""

    def __init__(self, device: torch.device, name: str = "prefill-forward") -> None:
        # A CUDA device is current per thread: the thread's must be the service's (use_device).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name, initializer=use_device,
                                        initargs=(device,))

    async def run(self, split: SplitModel, inputs: dict[str, Any], attend: Attend,
                  on_layer: Callable[[int], Awaitable[None]]) -> Any:
        """`split.run(inputs, attend)` on the thread, under inference mode; after
        attention i returned (it stored layer i's K and V), `on_layer(i)` runs on this
        loop, in layer order, while the layers after i compute. Returns the model's
        output once the forward and every `on_layer` have ended. The first `on_layer`
        failure stops the forward at its next layer and is raised. A failure of the
        forward is raised once the `on_layer` in progress has ended (a frame cut short
        would take its connection down); those not begun are dropped. Cancelled, the
        `on_layer` in progress is cancelled, and the forward stops at its next layer (a
        thread cannot be interrupted inside one)."""
        loop = asyncio.get_running_loop()
        finished: asyncio.Queue[int | None] = asyncio.Queue()
        stop = threading.Event()
        dropping = False  # the forward failed: no more on_layer

        def attend_and_hand_on(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if stop.is_set():
                raise ForwardStopped(f"the forward stopped before layer {i}")
            out = attend(i, q, k, v)
            loop.call_soon_threadsafe(finished.put_nowait, i)
            return out

        def forward() -> Any:
            with torch.inference_mode():
                return split.run(inputs, attend_and_hand_on)

        async def send_layers() -> None:
            while (i := await finished.get()) is not None and not dropping:
                await on_layer(i)

        computing = asyncio.wrap_future(self._pool.submit(forward))  # (after close: raises, nothing started)
        sends = asyncio.create_task(send_layers(), name="prefill-layer-sends")
        for f in (sends, computing):  # their errors retrieved even where another's is raised
            f.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            await asyncio.wait({computing, sends}, return_when=asyncio.FIRST_COMPLETED)
            if sends.done():  # a send failed (they end only after the forward's last layer)
                stop.set()
                await asyncio.wait({computing})
                sends.result()
            try:
                output = computing.result()
            except BaseException:
                dropping = True
                finished.put_nowait(None)
                await asyncio.gather(sends, return_exceptions=True)
                raise
            finished.put_nowait(None)
            await sends
            return output
        finally:
            stop.set()
            if not sends.done():  # this call was cancelled
                sends.cancel()
                await asyncio.gather(sends, return_exceptions=True)

    def close(self, wait: bool = False) -> None:
        """No more forwards; one in progress stops at its next layer (its `run` was
        cancelled), and the thread then ends; `wait`: return once it has."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

