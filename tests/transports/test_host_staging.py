"""transports/host_staging.until_done: a wait for the GPU polls its event between other
tasks' turns and is added to the process's clock of device waits (the services' metrics
lamina_*_device_wait_seconds_total), unless it is off the senders' path."""

from __future__ import annotations

import asyncio

from lamina.transports.host_staging import DEVICE_WAITS, WaitClock, until_done


class _Finishing:
    """An event whose work is done after `polls` queries (what a copy the GPU finishes
    later looks like to its poller); the same method as torch.cuda.Event's."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.queried = 0

    def query(self) -> bool:
        self.queried += 1
        return self.queried > self.polls


async def test_a_wait_for_the_device_is_clocked_while_other_tasks_run():
    clock = WaitClock()
    turns: list[int] = []

    async def other() -> None:
        for i in range(3):
            turns.append(i)
            await asyncio.sleep(0)

    task = asyncio.create_task(other())
    event = _Finishing(polls=5)
    await until_done(event, clock)  # type: ignore[arg-type]
    await task
    assert event.queried == 6 and turns == [0, 1, 2]  # the other task ran while it polled
    assert clock.seconds > 0
    waited = clock.seconds
    await until_done(_Finishing(polls=0), clock)  # type: ignore[arg-type]  # done at once: no wait
    assert clock.seconds == waited


async def test_the_default_clock_is_the_processes_and_a_wait_off_the_path_is_not_counted():
    before = DEVICE_WAITS.seconds
    await until_done(_Finishing(polls=2), clock=None)  # type: ignore[arg-type]
    assert DEVICE_WAITS.seconds == before
    await until_done(_Finishing(polls=2))  # type: ignore[arg-type]
    assert DEVICE_WAITS.seconds > before
