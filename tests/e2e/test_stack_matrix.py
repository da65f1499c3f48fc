"""Greedy identity with transformers across the data plane's settings.

Four settings vary: the transport (tcp, shm, ucx), the partitioning (request, head), the
decode pipeline's micro-batches (1, 2, 3) and Q-early (off, on). Every pair of values of
any two of them runs together in some row, rather than every combination (36 stacks): a
pairwise covering array of ten rows (nine at least, for transport x micro-batches), which
`test_every_pair_of_values_runs_together` checks. Every transport runs both partitionings
over two attention workers, where frames are split and gathered; one row runs head
partitioning over one worker (request partitioning over one worker is what the elastic
pool and prefix peers tests run, both checking greedy outputs too).

Four rows are stacks other tests share (shared_stacks.py), which cost no start of their
own: the API tests' stack, the two decode pipelines' (two model workers; float32 linears,
rotational) and prefix routing's (two prefill workers); the six over shm and ucx are the
matrix's own. The two requests
of a row run at once, so with more than one micro-batch both are in flight. Every row's
services are forked from the stack's forker (services/launch/forker.py) but one's, which
start in fresh interpreters (`fork_services: false`)."""

from __future__ import annotations

import asyncio
import itertools
import os
from pathlib import Path

import openai
import pytest
from e2e_helpers import CHAT_PROMPTS, COMPLETION_PROMPTS, MAX_TOKENS, api_key, metric_total
from shared_stacks import API, PIPELINE_FIXED, PIPELINE_ROTATIONAL, PREFILL_ROUTING, StackSpec

VALUES = {"transport": ("tcp", "shm", "ucx"), "partition": ("request", "head"), "micro_batches": (1, 2, 3),
          "q_early": (False, True)}

ROWS = [
    PREFILL_ROUTING,  # tcp, head over one worker, 1 micro-batch, Q-early (and two prefill workers)
    API,  # tcp, request, 2 micro-batches, no Q-early
    PIPELINE_FIXED,  # tcp, request, 3 micro-batches, Q-early
    PIPELINE_ROTATIONAL,  # tcp, head, 3 micro-batches, no Q-early
    StackSpec("shm", "request", micro_batches=1, q_early=False, fork_services=False),
    StackSpec("shm", "head", micro_batches=2, q_early=True),
    StackSpec("shm", "request", micro_batches=3, q_early=True),
    StackSpec("ucx", "head", micro_batches=1, q_early=False),
    StackSpec("ucx", "request", micro_batches=2, q_early=True),
    StackSpec("ucx", "head", micro_batches=3, q_early=True),
]


def test_every_pair_of_values_runs_together():
    for a, b in itertools.combinations(VALUES, 2):
        pairs = set(itertools.product(VALUES[a], VALUES[b]))
        ran = {(getattr(row, a), getattr(row, b)) for row in ROWS}
        assert ran == pairs, f"{a} x {b}: {sorted(pairs - ran)} in no row"
    over_two = {(row.transport, row.partition) for row in ROWS if row.workers == 2}
    assert over_two == set(itertools.product(VALUES["transport"], VALUES["partition"]))
    assert {row.workers for row in ROWS} == {1, 2}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("spec", [pytest.param(row, marks=pytest.mark.stack(row), id=row.id) for row in ROWS])
def test_greedy_identity(spec, stack, reference_outputs):
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)

    async def both():
        model = (await client.models.list()).data[0].id
        return await asyncio.gather(
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_PROMPTS[0]}],
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True}),
            client.completions.create(model=model, prompt=COMPLETION_PROMPTS[1], max_tokens=MAX_TOKENS,
                                      temperature=0, extra_body={"return_token_ids": True}))

    parents = {sp.name: _parent(sp.proc.pid) for sp in stack.processes}
    expected = stack.forker_pid if spec.fork_services else os.getpid()
    assert expected is not None and parents == dict.fromkeys(parents, expected), (expected, parents)
    q_frames_before = _q_early_frames(spec, stack)
    chat, completion = asyncio.run(both())
    # Q-early rows did send their queries early (and the others never do).
    assert (_q_early_frames(spec, stack) > q_frames_before) == spec.q_early
    ref = reference_outputs[("chat", CHAT_PROMPTS[0])]
    assert chat.choices[0].model_extra["token_ids"] == ref["token_ids"]
    assert chat.choices[0].message.content == ref["text"]
    ref = reference_outputs[("completion", COMPLETION_PROMPTS[1])]
    assert completion.choices[0].model_extra["token_ids"] == ref["token_ids"]
    assert completion.choices[0].text == ref["text"]


def _parent(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))


def _q_early_frames(spec: StackSpec, stack) -> float:
    """ATTEND_Q frames (Q-early's first halves) the stack's attention workers have handled."""
    return sum(metric_total(stack, "attention", f"attention-{w}", 'lamina_attention_frames_total{kind="ATTEND_Q"}')
               for w in range(spec.workers))
