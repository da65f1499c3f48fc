"""The decode pipeline end to end: several model workers and micro-batches, Q-early,
seeded sampling that does not depend on either, and requests that end mid-step.

Real processes over real sockets; the official openai client; transformers and the
local engine as the peers. The two stacks are shared (shared_stacks.PIPELINE_FIXED and
PIPELINE_ROTATIONAL) with rows of the transport matrix.
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from e2e_helpers import CHAT_PROMPTS, COMPLETION_PROMPTS, MAX_TOKENS, api_key, attention_stats, service_metric
from shared_stacks import PIPELINE_FIXED, PIPELINE_ROTATIONAL

pytestmark = pytest.mark.timeout(600)

SEEDED = [("Once upon a time", 11), ("The best way to learn", 12), ("My favourite food is", 13)]
SEEDED_TOKENS = 12

# Two model workers, three micro-batches: fixed with Q-early, request partitioning and
# float32 linears; rotational (M + 1 micro-batches) with head partitioning and the GGUF's
# own packed blocks, which compute with exactly the values transformers dequantizes, so
# greedy still matches.
PIPELINES = [PIPELINE_FIXED, PIPELINE_ROTATIONAL]


@pytest.fixture(scope="session")  # the two pipelines' tests run apart, each among its shared stack's tests
def seeded_reference(loaded_model):
    """The seeded samples of the local engine in one process: what any pipeline must give."""
    from lamina.engine import Engine, SamplingParams

    engine = Engine(loaded_model)
    tok = loaded_model.tokenizer
    outs = engine.generate([tok.encode(p) for p, _ in SEEDED],
                           [SamplingParams(max_tokens=SEEDED_TOKENS, temperature=0.8, top_p=0.95, seed=s,
                                           ignore_eos=True) for _, s in SEEDED])
    return [o.output_token_ids for o in outs]


async def _occupancy(stack) -> list[int]:
    return [s.num_tokens for s in await attention_stats(stack)]


@pytest.mark.parametrize("spec", [pytest.param(p, marks=pytest.mark.stack(p), id=p.id) for p in PIPELINES])
def test_pipeline_outputs_equal_the_peers(spec, stack, reference_outputs, seeded_reference):
    async def scenario():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
        model = (await client.models.list()).data[0].id
        greedy = [client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                                 max_tokens=MAX_TOKENS, temperature=0,
                                                 extra_body={"return_token_ids": True}) for p in CHAT_PROMPTS]
        greedy += [client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"return_token_ids": True}) for p in COMPLETION_PROMPTS]
        seeded = [client.completions.create(model=model, prompt=p, max_tokens=SEEDED_TOKENS, temperature=0.8,
                                            top_p=0.95, seed=s, extra_body={"return_token_ids": True,
                                                                            "ignore_eos": True})
                  for p, s in SEEDED]
        # All at once: several per micro-batch, spread over the model workers.
        results = await asyncio.gather(*greedy, *seeded)
        await client.close()
        return results[: len(greedy)], results[len(greedy):]

    rotational = spec.pipeline_mode == "rotational"
    served = service_metric(stack, "model", "model-1", "lamina_model_served_slices_total") if rotational else 0
    greedy, seeded = asyncio.run(scenario())
    keys = [("chat", p) for p in CHAT_PROMPTS] + [("completion", p) for p in COMPLETION_PROMPTS]
    for key, r in zip(keys, greedy):
        assert r.choices[0].model_extra["token_ids"] == reference_outputs[key]["token_ids"], key
    assert [r.choices[0].model_extra["token_ids"] for r in seeded] == seeded_reference
    if rotational:  # the peer model worker ran slices for the coordinator
        assert service_metric(stack, "model", "model-1", "lamina_model_served_slices_total") > served


@pytest.mark.stack(PIPELINE_FIXED)
def test_requests_ending_mid_step_leave_no_kv_behind(stack, reference_outputs):
    """Finished, aborted and disconnected requests among pipelined micro-batches on two
    model workers: afterwards no attention worker holds a token, and the requests that
    ran to the end are exact."""
    async def scenario():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
        model = (await client.models.list()).data[0].id

        async def disconnect_after(n_chunks: int, i: int) -> int:
            stream = await client.completions.create(model=model, prompt=f"Count slowly, round {i}: one, two,",
                                                     max_tokens=400, temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == n_chunks:
                    break
            await stream.close()  # the client goes away while its micro-batch is mid-step
            return seen

        async def short(i: int):
            return await client.completions.create(model=model, prompt=f"Say {i} words:", max_tokens=1 + i,
                                                   temperature=0, extra_body={"ignore_eos": True})

        p = COMPLETION_PROMPTS[0]
        exact = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True})
        results = await asyncio.gather(exact, *(disconnect_after(2 + 3 * i, i) for i in range(6)),
                                       *(short(i) for i in range(6)))
        for _ in range(100):
            if sum(await _occupancy(stack)) == 0:
                break
            await asyncio.sleep(0.1)  # polling other processes' state over gRPC
        await client.close()
        return results, await _occupancy(stack)

    results, occupancy = asyncio.run(scenario())
    assert occupancy == [0, 0], f"KV left on the attention workers: {occupancy} tokens"
    assert results[0].choices[0].model_extra["token_ids"] == \
        reference_outputs[("completion", COMPLETION_PROMPTS[0])]["token_ids"]
    assert [r.usage.completion_tokens for r in results[7:]] == [1 + i for i in range(6)]
