"""The model worker's micro-batch pipeline without processes: membership policy and DecodeRunner.

The runner is driven with a forward function that stands in for the slices and the
attention pool (it yields to the event loop once per "layer", as the real one does
while it awaits attention replies), so the tests see exactly which sequences each
micro-batch steps, and when.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from lamina import transports
from lamina.services.model.decode_runner import DecodeRunner
from lamina.services.model.micro_batches import join_target, num_active, rebalance
from lamina.services.protos import lamina_pb2
from lamina.services.wire import RemoteError

VOCAB = 64
EOS = 63


def test_join_goes_to_the_smallest_micro_batch():
    assert join_target([3, 1, 2]) == 1
    assert join_target([2, 2, 2]) == 0
    assert join_target([3, 2, 0], active=2) == 1  # micro-batch 2 is not active


def test_micro_batches_stay_at_least_the_minimum_size():
    assert [num_active(n, 3, 16) for n in (0, 15, 16, 31, 32, 47, 48, 200)] == [1, 1, 1, 1, 2, 2, 3, 3]
    assert num_active(5, 2, 1) == 2


def test_an_inactive_micro_batch_gives_everything_away():
    assert rebalance(2, [3, 3, 2], active=2) == [0, 1]
    assert rebalance(1, [1, 4], active=1) == [0, 0, 0, 0]


@pytest.mark.parametrize(("own", "sizes", "moves"), [
    (0, [5, 1], [1, 1]),          # 5/1 -> 3/3
    (0, [4, 3], []),              # within one: stays
    (1, [0, 6, 0], [0, 2, 0, 2]),  # 0/6/0 -> 2/2/2
    (0, [1, 5], []),              # only the micro-batch starting its step gives away
])
def test_rebalance_moves_only_the_excess_of_the_starting_micro_batch(own, sizes, moves):
    assert rebalance(own, sizes) == moves


def _seq(seq_id: str, position: int, max_tokens: int = 100, token: int = 1) -> lamina_pb2.StepSequence:
    return lamina_pb2.StepSequence(seq_id=seq_id, token_id=token, position=position, output_index=1,
                                   params=lamina_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, seed=5),
                                   placement=lamina_pb2.Placement(workers=[0]))


class FakeSlices:
    """Greedy 'model': the next token is (position + 1) % VOCAB, EOS at position 62."""

    def __init__(self, layers: int = 3) -> None:
        self.layers = layers
        self.in_flight = 0
        self.max_in_flight = 0
        self.steps: list[tuple[int, int, list[str]]] = []  # (micro_batch, step, seq ids)
        self.fail_micro_batch: int | None = None
        self.failure: Exception = RemoteError("kv_full", "no room")

    async def forward(self, mb, step, batch, rows):
        self.steps.append((mb, step, list(batch.seq_ids)))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            for _ in range(self.layers):
                await asyncio.sleep(0)  # awaiting an attention reply
                if self.fail_micro_batch == mb:
                    self.fail_micro_batch = None  # once
                    raise self.failure
        finally:
            self.in_flight -= 1
        logits = torch.zeros(len(batch.seq_ids), VOCAB)
        logits[torch.arange(len(batch.seq_ids)), (batch.positions + 1) % VOCAB] = 1.0
        return logits


async def _collect(runner: DecodeRunner, until) -> list[lamina_pb2.DecodeResult]:
    results = []
    while not until(results):
        results.append(await asyncio.wait_for(runner.results.get(), 5))
    return results


def _tokens(results) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in results:
        for t in r.tokens:
            out.setdefault(t.seq_id, []).append(t.token_id)
    return out


def _run(coro):
    return asyncio.run(coro)


def test_micro_batches_are_in_flight_together_and_tokens_follow_positions():
    async def main():
        fake = FakeSlices()
        runner = DecodeRunner(fake.forward, 2, lamina_pb2.StopRule(eos_token_ids=[EOS], max_model_len=1000))
        runner.join([_seq(f"s{i}", 10 * i, max_tokens=5) for i in range(4)])
        runner.start()
        try:
            results = await _collect(runner, lambda rs: sum(t.finished for r in rs for t in r.tokens) == 4)
        finally:
            await runner.close()
        return fake, results

    fake, results = _run(main())
    assert fake.max_in_flight == 2  # staggered: both micro-batches between their layers at once
    members = {mb: set(ids) for mb, _, ids in fake.steps}
    assert members[0].isdisjoint(members[1]) and len(members[0]) == len(members[1]) == 2
    # Each sequence: 4 more tokens (it joined with 1 of max_tokens 5), from position + 1 on.
    assert _tokens(results) == {f"s{i}": [10 * i + 1 + j for j in range(4)] for i in range(4)}
    finished = [t for r in results for t in r.tokens if t.finished]
    assert sorted(t.seq_id for t in finished) == ["s0", "s1", "s2", "s3"]


def test_eos_and_context_end_sequences_by_the_schedulers_rule():
    async def main():
        fake = FakeSlices()
        runner = DecodeRunner(fake.forward, 2, lamina_pb2.StopRule(eos_token_ids=[EOS], max_model_len=100))
        runner.join([_seq("eos", 60), _seq("ctx", 95)])
        runner.start()
        try:
            return await _collect(runner, lambda rs: sum(t.finished for r in rs for t in r.tokens) == 2)
        finally:
            await runner.close()

    toks = _tokens(_run(main()))
    assert toks["eos"] == [61, 62, EOS]  # ends on EOS
    assert toks["ctx"] == [32, 33, 34, 35]  # positions 96..99: the 100-token context is full


def test_a_leaving_sequence_finishes_its_step_in_flight_and_is_in_no_later_step():
    async def main():
        fake = FakeSlices(layers=5)
        runner = DecodeRunner(fake.forward, 1, lamina_pb2.StopRule(max_model_len=1000))
        runner.join([_seq("stay", 0), _seq("go", 100)])
        runner.start()
        try:
            await asyncio.sleep(0)  # the first step is now in flight
            await asyncio.sleep(0)
            runner.leave(["go", "never-joined"])
            results = await _collect(runner, lambda rs: sum("go" in r.left for r in rs) == 1
                                     and sum("never-joined" in r.left for r in rs) == 1)
            more = await _collect(runner, lambda rs: len(rs) == 3)
        finally:
            await runner.close()
        return fake, results, more

    fake, results, more = _run(main())
    left_at = next(i for i, r in enumerate(results) if "go" in r.left)
    assert all("go" not in ids for _, step, ids in fake.steps[left_at + 1:])
    assert "go" not in _tokens(more) and _tokens(more)["stay"]
    assert fake.steps[0][2] == ["stay", "go"]


@pytest.mark.parametrize(("failure", "code"), [(RemoteError("kv_full", "no room"), "kv_full"),
                                               (ValueError("a bug"), "internal")])
def test_a_failed_step_fails_its_micro_batch_only(failure, code):
    async def main():
        fake = FakeSlices()
        fake.failure = failure
        runner = DecodeRunner(fake.forward, 2, lamina_pb2.StopRule(max_model_len=1000))
        runner.join([_seq("a", 0), _seq("b", 0), _seq("c", 0), _seq("d", 0)])
        fake.fail_micro_batch = 1
        runner.start()
        try:
            results = await _collect(runner, lambda rs: any(r.failed for r in rs) and len(rs) >= 4)
        finally:
            await runner.close()
        return fake, results

    fake, results = _run(main())
    failed = {f.seq_id: f.code for r in results for f in r.failed}
    doomed = set(next(ids for mb, _, ids in fake.steps if mb == 1))
    assert set(failed) == doomed == {"b", "d"} and set(failed.values()) == {code}
    assert set(_tokens(results)) == {"a", "c"}  # the other micro-batch went on
    assert all("b" not in ids and "d" not in ids for _, _, ids in fake.steps[2:])


def test_a_torn_frame_found_during_a_step_fails_it_and_no_token_of_it_goes_out(monkeypatch):
    """A frame found torn (transports.torn_frames grew: a vanished peer's device-ordered
    reply) while micro-batch 1's first step read its replies fails that step, and micro-
    batch 0's, in flight at the time (the count does not say whose frame it was); the
    steps after it, of sequences that joined later, go on."""
    found = [0]
    monkeypatch.setattr(transports, "torn_frames", lambda: found[0])

    class Tearing(FakeSlices):
        async def forward(self, mb, step, batch, rows):
            if (mb, step) == (1, 1):
                found[0] += 1  # found while this step's replies arrive
            return await super().forward(mb, step, batch, rows)

    async def main():
        fake = Tearing()
        runner = DecodeRunner(fake.forward, 2, lamina_pb2.StopRule(max_model_len=1000))
        runner.join([_seq("a", 0), _seq("b", 0), _seq("c", 0), _seq("d", 0)])
        runner.start()
        try:
            results = await _collect(runner, lambda rs: sum(len(r.failed) for r in rs) == 4)
            runner.join([_seq("e", 0)])
            results += await _collect(runner, lambda rs: len(rs) == 2)
        finally:
            await runner.close()
        return results

    results = _run(main())
    failed = {f.seq_id: f.code for r in results for f in r.failed}
    assert failed == dict.fromkeys("abcd", "transport")
    assert all("found torn" in f.message for r in results for f in r.failed)
    assert set(_tokens(results)) == {"e"}  # nothing of the failed steps; the next one's tokens


def test_few_sequences_run_in_one_micro_batch_until_there_are_enough_for_two():
    async def main():
        fake = FakeSlices()
        runner = DecodeRunner(fake.forward, 2, lamina_pb2.StopRule(max_model_len=1000), min_micro_batch=3)
        runner.join([_seq(f"s{i}", 0) for i in range(5)])  # 5 // 3 = 1 active micro-batch
        runner.start()
        try:
            await _collect(runner, lambda rs: len(rs) >= 2)
            runner.join([_seq("s5", 0)])  # 6 // 3 = 2: the next steps split 3 and 3
            await _collect(runner, lambda rs: len(rs) >= 6)
        finally:
            await runner.close()
        return fake

    fake = _run(main())
    assert fake.steps[0][0] == 0 and len(fake.steps[0][2]) == 5
    last = {mb: ids for mb, _, ids in fake.steps}
    assert sorted(len(ids) for ids in last.values()) == [3, 3]


def test_joins_rebalance_micro_batches_as_sequences_leave():
    async def main():
        fake = FakeSlices()
        runner = DecodeRunner(fake.forward, 2, lamina_pb2.StopRule(max_model_len=1000))
        # Micro-batch 1's sequences all end after 2 tokens; micro-batch 0's go on.
        runner.join([_seq("long0", 0), _seq("short0", 0, max_tokens=3), _seq("long1", 0),
                     _seq("short1", 0, max_tokens=3), _seq("long2", 0), _seq("long3", 0)])
        runner.start()
        try:
            await _collect(runner, lambda rs: len(rs) >= 12)
        finally:
            await runner.close()
        return fake

    fake = _run(main())
    last = {mb: ids for mb, _, ids in fake.steps}
    assert {len(last[0]), len(last[1])} == {2}  # 4 long sequences, 2 and 2 again


def test_logprobs_are_sent_only_for_sequences_that_ask():
    async def main():
        fake = FakeSlices()
        runner = DecodeRunner(fake.forward, 1, lamina_pb2.StopRule(max_model_len=1000))
        asking = _seq("asks", 0, max_tokens=3)
        asking.params.logprobs, asking.params.top_logprobs = True, 2
        runner.join([asking, _seq("plain", 10, max_tokens=3)])
        runner.start()
        try:
            return await _collect(runner, lambda rs: sum(t.finished for r in rs for t in r.tokens) == 2)
        finally:
            await runner.close()

    tokens = [t for r in _run(main()) for t in r.tokens]
    lsm = torch.log_softmax(torch.tensor([1.0] + [0.0] * (VOCAB - 1)), dim=-1)  # the fake's logits, shifted
    for t in tokens:
        if t.seq_id == "plain":
            assert not t.HasField("logprobs")
        else:
            assert t.logprobs.logprob == pytest.approx(lsm[0].item())
            assert t.logprobs.top[0].token_id == t.token_id and len(t.logprobs.top) == 2


def test_penalties_use_the_history_sent_at_join():
    """A sequence that joins with its outputs so far (as after a rebuild elsewhere) is
    penalized for them: the fake's next token (position + 1) already appeared."""
    async def main(history):
        fake = FakeSlices()
        runner = DecodeRunner(fake.forward, 1, lamina_pb2.StopRule(max_model_len=1000))
        seq = _seq("s", 10, max_tokens=2)
        seq.params.frequency_penalty = 2.0
        seq.output_token_ids.extend(history)
        runner.join([seq])
        runner.start()
        try:
            return _tokens(await _collect(runner, lambda rs: any(t.finished for r in rs for t in r.tokens)))["s"]
        finally:
            await runner.close()

    assert _run(main([10])) == [11]  # 11 has not appeared: the fake's choice
    assert _run(main([11])) == [0]  # 11 has: 1 - 2 < 0, and token 0 is the first of the rest


def test_a_step_that_awaits_nothing_waits_for_its_result_to_be_taken():
    """Colocated (hand_off_s): a step that never awaits a peer gives the loop to the
    stream until it took the result, and not longer; with nobody taking results, each
    step waits the whole hand_off_s. Either way the runner closes."""

    async def steps_in(seconds: float, take: bool) -> int:
        fake = FakeSlices(layers=0)  # awaits nothing: the loop is the step's alone
        runner = DecodeRunner(fake.forward, 1, lamina_pb2.StopRule(max_model_len=100_000), hand_off_s=0.05)
        runner.join([_seq("s", 0, max_tokens=100_000)])
        taken = []

        async def consume() -> None:
            while True:
                await runner.results.get()
                runner.taken()
                taken.append(time.monotonic())

        consumer = asyncio.create_task(consume()) if take else None
        runner.start()
        await asyncio.sleep(seconds)
        await asyncio.wait_for(runner.close(), 5)  # a cancellation lost in the hand-off would hang here
        if consumer is not None:
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            assert len(taken) >= len(fake.steps) - 1  # every result taken as it came
        return len(fake.steps)

    untaken = _run(steps_in(0.5, take=False))
    assert 5 <= untaken <= 11  # one step per hand_off_s
    assert _run(steps_in(0.5, take=True)) > 10 * untaken
