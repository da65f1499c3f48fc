"""The OpenAI API of the whole stack, through the official client, against transformers.

Every test here shares one stack (shared_stacks.API, whose gateway wants an API key) with
the web page tests and a row of the transport matrix: each checks differences of
counters, or occupancy while nothing else is in flight."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
import uuid
from typing import Literal

import openai
import pydantic
import pytest
from e2e_helpers import CHAT_PROMPTS, COMPLETION_PROMPTS, MAX_TOKENS, api_key, attention_stats, service_metric
from shared_stacks import API

pytestmark = [pytest.mark.timeout(600), pytest.mark.stack(API)]


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)


def _model(stack) -> str:
    return _client(stack).models.list().data[0].id


def test_chat_and_completions_equal_transformers(stack, reference_outputs):
    client, model = _client(stack), _model(stack)
    for p in CHAT_PROMPTS:
        ref = reference_outputs[("chat", p)]
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],
                                           max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == ref["token_ids"]  # token for token
        assert r.choices[0].message.content == ref["text"]
        assert r.usage.prompt_tokens == len(ref["prompt_ids"])
        assert r.usage.completion_tokens == len(ref["token_ids"])
        assert r.choices[0].finish_reason == ("stop" if len(ref["token_ids"]) < MAX_TOKENS else "length")
        # Streaming gives the same text, chunk by chunk, and the usage when asked.
        chunks = list(client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
        assert chunks[-1].usage.completion_tokens == len(ref["token_ids"])
    for p in COMPLETION_PROMPTS:
        ref = reference_outputs[("completion", p)]
        r = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                      extra_body={"return_token_ids": True})
        assert r.choices[0].model_extra["token_ids"] == ref["token_ids"]
        assert r.choices[0].text == ref["text"]
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref["prompt_ids"]), len(ref["token_ids"]))
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)
        assert streamed == ref["text"]


def test_a_prompt_of_several_prefill_chunks_equals_transformers(stack, loaded_model, hf_reference):
    """A prompt of about three of the prefill worker's chunks (prefill.chunk_tokens, auto:
    512 on a CPU) is computed in as many forwards, its KV kept between them; its
    greedy continuation is still transformers'."""
    import torch

    text = " ".join(f"Shelf {i} holds the {('red', 'green', 'blue')[i % 3]} box of {i * 7 % 13} stones."
                    for i in range(90))
    ids = loaded_model.tokenizer.encode(text)
    assert 2 * 512 < len(ids) < 3 * 512
    with torch.no_grad():
        gen = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=MAX_TOKENS, do_sample=False)
    chunks = _prefill_metric(stack, "lamina_prefill_chunks_total")
    r = _client(stack).completions.create(model=_model(stack), prompt=text, max_tokens=MAX_TOKENS, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].model_extra["token_ids"] == gen[0, len(ids):].tolist()
    assert _prefill_metric(stack, "lamina_prefill_chunks_total") - chunks == 2  # forwards before its last


def test_sixteen_concurrent_requests_of_different_lengths(stack, loaded_model):
    from lamina.engine import Engine, SamplingParams

    model = _model(stack)
    prompts = [("word " * (1 + 5 * i)) + f"number {i} is" for i in range(16)]
    lengths = [4 + (i % 5) * 3 for i in range(16)]

    async def run_all():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
        return await asyncio.gather(*(client.completions.create(model=model, prompt=p, max_tokens=n,
                                                                temperature=0)
                                      for p, n in zip(prompts, lengths)))

    forwards, prompted = _prefill_metric(stack, "lamina_prefill_batch_prompts_count"), \
        _prefill_metric(stack, "lamina_prefill_batch_prompts_sum")
    results = asyncio.run(run_all())
    # Prompts that arrived together were prefilled in shared forwards.
    forwards = _prefill_metric(stack, "lamina_prefill_batch_prompts_count") - forwards
    prompted = _prefill_metric(stack, "lamina_prefill_batch_prompts_sum") - prompted
    assert prompted == 16 and forwards < 16
    # Each equals the request run alone through the local engine (greedy; batch invariant).
    engine = Engine(loaded_model)
    tok = loaded_model.tokenizer
    for p, n, r in zip(prompts, lengths, results):
        (alone,) = engine.generate([tok.encode(p)], SamplingParams(max_tokens=n, temperature=0.0))
        assert r.choices[0].text == alone.text
        assert r.usage.completion_tokens == len(alone.output_token_ids)


async def _attention_occupancy(stack) -> list[int]:
    return [s.num_sequences for s in await attention_stats(stack)]


def test_client_disconnect_frees_kv(stack):
    model = _model(stack)

    async def scenario():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
        stream = await client.completions.create(model=model, prompt="Count slowly: one, two,", max_tokens=400,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True})
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        assert sum(await _attention_occupancy(stack)) == 1  # the request's KV is on a worker
        await stream.close()  # the client goes away mid-stream
        for _ in range(100):
            if sum(await _attention_occupancy(stack)) == 0:
                return
            await asyncio.sleep(0.1)  # polling another process's state over gRPC
        raise AssertionError(f"KV not freed: {await _attention_occupancy(stack)}")

    asyncio.run(scenario())


def _post(stack, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(stack.base_url + path, data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {api_key(stack)}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_input_is_answered_clearly_while_others_continue(stack, reference_outputs):
    model = _model(stack)

    async def scenario():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
        p = COMPLETION_PROMPTS[0]
        good = asyncio.create_task(client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS,
                                                             temperature=0))
        loop = asyncio.get_running_loop()
        cases = [
            (b'{"model": "x", "messages": [', 400),  # malformed JSON
            (json.dumps({"model": model, "messages": "hello"}).encode(), 400),  # wrong type
            (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),
            (json.dumps({"model": model, "messages": [{"role": "user", "content": "word " * 9000}]}).encode(), 400),
            (json.dumps({"model": model, "n": 17, "messages": [{"role": "user", "content": "hi"}]}).encode(), 400),
        ]
        for body, status in cases:
            code, payload = await loop.run_in_executor(None, _post, stack, "/v1/chat/completions", body)
            assert code == status, payload
            assert payload["error"]["message"]
            assert "type" in payload["error"]
        r = await good
        assert r.choices[0].text == reference_outputs[("completion", p)]["text"]

    asyncio.run(scenario())


def test_health_and_metrics(stack):
    with urllib.request.urlopen(stack.base_url + "/health", timeout=10) as r:
        assert r.status == 200
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "lamina" in text
    # Each worker ran its warm-up forward before it served (services/warm_up.py).
    assert service_metric(stack, "prefill", "prefill-0", "lamina_prefill_warm_up_seconds") > 0
    assert service_metric(stack, "model", "model-0", "lamina_model_warm_up_seconds") > 0


def _prefill_metric(stack, name: str) -> float:
    return service_metric(stack, "prefill", "prefill-0", name)


def _prefill_cached_tokens(stack) -> float:
    return _prefill_metric(stack, "lamina_prefill_cached_tokens_total")


def test_prefix_cache_hit_gives_the_same_tokens(stack):
    client, model = _client(stack), _model(stack)
    shared = "You are a careful assistant. " * 12
    before = _prefill_cached_tokens(stack)
    first = client.completions.create(model=model, prompt=shared + "Question: what is two plus two?",
                                      max_tokens=MAX_TOKENS, temperature=0)
    middle = _prefill_cached_tokens(stack)
    second = client.completions.create(model=model, prompt=shared + "Question: what is two plus two?",
                                       max_tokens=MAX_TOKENS, temperature=0)
    after = _prefill_cached_tokens(stack)
    assert after - middle >= 64  # the second prefill read its shared prefix from the cache
    assert middle - before < after - middle
    assert second.choices[0].text == first.choices[0].text
    assert (second.usage.prompt_tokens, second.usage.completion_tokens) == (
        first.usage.prompt_tokens, first.usage.completion_tokens)  # (cached_tokens differ: the next test)


def test_usage_names_the_prompt_tokens_the_prefix_cache_served(stack):
    """usage.prompt_tokens_details.cached_tokens is the prefill worker's own count: 0 for a
    prompt whose first token no cached block starts with; for the same prompt again, every
    token but the last (computed for its logits), in full blocks of cache_block_tokens,
    the last of them cut one short when the prompt fills its last block."""
    client, model = _client(stack), _model(stack)
    prompt = f"Quagga ledger {uuid.uuid4().hex}: " + " ".join(f"crate {i} holds {i * 7 % 50} jars;" for i in range(30))
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    again = chunks[-1].usage
    n, block = first.usage.prompt_tokens, stack.config.prefill.cache_block_tokens
    assert n > 8 * block and again.prompt_tokens == n
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.prompt_tokens_details.cached_tokens == min(n // block * block, n - 1)


def _reference_logprobs(hf, prompt: list[int], outputs: list[int]):
    """transformers' log-softmax (float32) at each output position: [len(outputs), V]."""
    import torch

    ids = torch.tensor([prompt + outputs[:-1]])
    with torch.no_grad():
        logits = hf(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1:]


def _assert_close_to(ref, token_ids: list[int], logprobs: list[float], tops: list[list[float]]) -> None:
    assert len(logprobs) == len(token_ids) == len(tops)
    for i, (t, lp, top) in enumerate(zip(token_ids, logprobs, tops)):
        assert abs(lp - ref[i, t].item()) < 1e-4, (i, lp, ref[i, t].item())
        want = ref[i].topk(len(top)).values.tolist()
        assert max((abs(a - b) for a, b in zip(top, want)), default=0.0) < 1e-4


def test_logprobs_equal_transformers(stack, reference_outputs, hf_reference):
    client, model = _client(stack), _model(stack)
    p = CHAT_PROMPTS[0]
    ref = reference_outputs[("chat", p)]
    ref_lp = _reference_logprobs(hf_reference, ref["prompt_ids"], ref["token_ids"])
    messages = [{"role": "user", "content": p}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    _assert_close_to(ref_lp, ref["token_ids"], [c.logprob for c in content],
                     [[a.logprob for a in c.top_logprobs] for c in content])
    # The first token's come from the prefill service, the rest from the model worker.
    assert "".join(c.token for c in content).startswith(ref["text"])
    streamed = [c for chunk in client.chat.completions.create(
        model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3,
        stream=True) if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    # (equal to 1e-4, not bit for bit: the second prefill of the prompt starts from the prefix cache)
    assert [c.token for c in streamed] == [c.token for c in content]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(streamed, content)) < 1e-4

    p = COMPLETION_PROMPTS[0]
    ref = reference_outputs[("completion", p)]
    ref_lp = _reference_logprobs(hf_reference, ref["prompt_ids"], ref["token_ids"])
    r = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    tops = [sorted(d.values(), reverse=True)[:2] for d in lp.top_logprobs]
    _assert_close_to(ref_lp, ref["token_ids"], lp.token_logprobs, tops)


def test_continuous_usage_stats_in_every_chunk(stack, reference_outputs):
    client, model = _client(stack), _model(stack)
    p = COMPLETION_PROMPTS[1]
    ref = reference_outputs[("completion", p)]
    chunks = list(client.completions.create(
        model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens == len(ref["prompt_ids"]) for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == len(ref["token_ids"]) and counts[0] >= 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]


def test_penalties_and_biases_equal_the_local_engine(stack, reference_outputs, loaded_model):
    """Each request's tokens equal the local engine's with the same parameters (greedy), and
    differ from the unpenalized ones: the prefill worker samples the first token with the
    prompt alone, the model worker the rest with the history sent when the sequence joined."""
    from lamina.engine import Engine, SamplingParams

    client, model = _client(stack), _model(stack)
    engine = Engine(loaded_model)
    tok = loaded_model.tokenizer
    chat_ref = reference_outputs[("chat", CHAT_PROMPTS[1])]
    completion_ref = reference_outputs[("completion", COMPLETION_PROMPTS[0])]
    banned = chat_ref["token_ids"][0]  # the unpenalized first token, biased away
    cases = [
        ("chat", chat_ref, {"frequency_penalty": 1.5, "presence_penalty": 0.5, "logit_bias": {str(banned): -100},
                            "min_tokens": MAX_TOKENS}),
        ("completion", completion_ref, {"repetition_penalty": 1.5}),
        ("completion", completion_ref, {"presence_penalty": 1.0, "frequency_penalty": 1.0}),
    ]
    for kind, ref, fields in cases:
        extra = {"return_token_ids": True, **{k: v for k, v in fields.items()
                                              if k in ("repetition_penalty", "min_tokens")}}
        openai_fields = {k: v for k, v in fields.items() if k not in extra}
        if kind == "chat":
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_PROMPTS[1]}],
                                               max_tokens=MAX_TOKENS, temperature=0, extra_body=extra,
                                               **openai_fields)
        else:
            r = client.completions.create(model=model, prompt=COMPLETION_PROMPTS[0], max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body=extra, **openai_fields)
        got = r.choices[0].model_extra["token_ids"]
        bias = tuple(sorted((int(t), float(b)) for t, b in fields.get("logit_bias", {}).items()))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logit_bias=bias,
                                **{k: v for k, v in fields.items() if k != "logit_bias"})
        (local,) = engine.generate([ref["prompt_ids"]], params)
        assert got == local.output_token_ids, (kind, fields, tok.decode(got), tok.decode(local.output_token_ids))
        assert got != ref["token_ids"]
        if "min_tokens" in fields:
            assert len(got) == MAX_TOKENS and banned not in got


def test_the_vllm_extensions_load_generators_send(stack, reference_outputs, loaded_model):
    """guidellm's streamed request (ignore_eos, stop null, usage in every chunk) gets exactly
    max_tokens tokens, greedy as transformers up to and past EOS; stop_token_ids,
    include_stop_str_in_output and skip_special_tokens do what vLLM documents."""
    client, model, tok = _client(stack), _model(stack), loaded_model.tokenizer
    p = CHAT_PROMPTS[0]
    messages = [{"role": "user", "content": p}]
    ids = reference_outputs[("chat", p)]["token_ids"]
    assert ids[-1] in tok.eos_token_ids and len(ids) < MAX_TOKENS and ids[3] not in ids[:3]  # ends early
    # As guidellm 0.8.1 sends a chat request, with the special tokens' text shown.
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, temperature=0, stream=True, max_completion_tokens=MAX_TOKENS, stop=None,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True, "skip_special_tokens": False}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == MAX_TOKENS
    got = [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []]
    assert len(got) == MAX_TOKENS and got[:len(ids)] == ids
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tok.decode(got, skip_special_tokens=False) and "<|im_end|>" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # stop_token_ids: the output ends at the id, its text without it unless include_stop_str_in_output.
    for include, shown in ((False, 3), (True, 4)):
        r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                           extra_body={"stop_token_ids": [ids[3]], "return_token_ids": True,
                                                       "include_stop_str_in_output": include})
        assert r.choices[0].model_extra["token_ids"] == ids[:4] and r.choices[0].finish_reason == "stop"
        assert r.choices[0].message.content == tok.decode(ids[:shown])
    # A stop string kept at the end of the text.
    answer = tok.decode(ids)
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                       stop=["Paris"], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].message.content == answer[:answer.index("Paris") + len("Paris")]
    assert r.choices[0].finish_reason == "stop"


def test_echo_scores_the_prompt_as_transformers(stack, reference_outputs, hf_reference):
    """Log-likelihood scoring (lm-eval's loglikelihood): echo, logprobs, max_tokens 0."""
    client, model = _client(stack), _model(stack)
    p = COMPLETION_PROMPTS[1]
    ref = reference_outputs[("completion", p)]
    prompt = ref["prompt_ids"]
    ref_lp = _reference_logprobs(hf_reference, prompt, ref["token_ids"])  # rows from the prompt's last token
    full = _reference_logprobs(hf_reference, prompt[:1], prompt[1:] + [0])  # rows scoring prompt tokens 1..
    r = client.completions.create(model=model, prompt=p, max_tokens=0, echo=True, logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == p and r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    tops = [sorted(d.values(), reverse=True)[:2] for d in lp.top_logprobs[1:]]
    _assert_close_to(full, prompt[1:], lp.token_logprobs[1:], tops)
    # With a completion: the prompt's, then the generated tokens'.
    r = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, echo=True,
                                  logprobs=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == p + ref["text"]
    assert len(lp.tokens) == len(prompt) + len(ref["token_ids"])
    _assert_close_to(ref_lp, ref["token_ids"], lp.token_logprobs[len(prompt):], [[]] * len(ref["token_ids"]))


def test_n_greedy_choices_each_equal_transformers_from_one_prefill(stack, reference_outputs):
    """n = 3 at temperature 0: three identical greedy choices, each transformers' tokens,
    from one prefill of the prompt (its other choices fork its KV)."""
    client, model = _client(stack), _model(stack)
    p = CHAT_PROMPTS[1]
    ref = reference_outputs[("chat", p)]
    prompts = _prefill_metric(stack, "lamina_prefill_requests_total")
    computed = _prefill_metric(stack, "lamina_prefill_tokens_total")
    cached = _prefill_cached_tokens(stack)
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], n=3,
                                       max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True})
    assert _prefill_metric(stack, "lamina_prefill_requests_total") - prompts == 1
    prefilled = (_prefill_metric(stack, "lamina_prefill_tokens_total") - computed
                 + _prefill_cached_tokens(stack) - cached)
    assert prefilled == len(ref["prompt_ids"])  # the prompt once, not three times
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        assert c.model_extra["token_ids"] == ref["token_ids"] and c.message.content == ref["text"]
    assert r.usage.prompt_tokens == len(ref["prompt_ids"])
    assert r.usage.completion_tokens == 3 * len(ref["token_ids"])
    # Streamed, the choices' chunks reassemble into the same texts.
    texts = ["", ""]
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], n=2,
                                                max_tokens=MAX_TOKENS, temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [ref["text"]] * 2


def test_n_seeded_choices_differ_and_repeat(stack):
    client, model = _client(stack), _model(stack)

    def run(n: int, stream: bool = False) -> list[str]:
        kw = dict(model=model, prompt=COMPLETION_PROMPTS[0], n=n, max_tokens=12, temperature=1.0, seed=1234)
        if not stream:
            return [c.text for c in client.completions.create(**kw).choices]
        texts = [""] * n
        for chunk in client.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.text
        return texts

    first = run(3)
    assert len(set(first)) == 3  # sampled independently
    assert run(3) == first  # and reproducibly: each choice's seed comes from the request's
    assert run(3, stream=True) == first
    assert run(1) == first[:1]  # choice 0 samples with the request's own seed


def test_n_choices_share_the_prompt_kv_and_a_disconnect_frees_them_all(stack, loaded_model):
    """While three choices decode, their attention worker holds the prompt once: its
    sequences' tokens exceed the slots in use by two prompts' worth exactly."""
    model = _model(stack)
    prompt = loaded_model.tokenizer.encode("Count slowly: " + "one, two, three, four, " * 8)

    async def scenario():
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=api_key(stack), max_retries=0)
        stream = await client.completions.create(model=model, prompt=prompt, n=3, max_tokens=400, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        seen = set()
        async for chunk in stream:
            seen.update(c.index for c in chunk.choices)
            if len(seen) == 3:
                break
        stats = await attention_stats(stack)
        assert sum(s.num_sequences for s in stats) == 3
        held = sum(s.num_tokens for s in stats)
        assert sum(s.num_sequence_tokens for s in stats) - held == 2 * len(prompt)
        assert held < 2 * len(prompt)  # the prompt and a few tokens of each choice
        await stream.close()  # the client goes away: every choice ends and frees its KV
        for _ in range(100):
            if sum(await _attention_occupancy(stack)) == 0:
                assert sum(s.num_tokens for s in await attention_stats(stack)) == 0
                return
            await asyncio.sleep(0.1)  # polling another process's state over gRPC
        raise AssertionError(f"KV not freed: {await _attention_occupancy(stack)}")

    asyncio.run(scenario())


# --- structured output and tools: constrained decoding (gateway/structured.py) -------------


class _City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


def test_structured_output_with_the_clients_typed_parsing(stack, loaded_model):
    """A pydantic response_format parses; JSON mode's greedy tokens equal the local
    engine's under the same grammar (equal to transformers with the same masks:
    tests/model/test_grammar.py); a seeded sampled request repeats; a bad schema is a 400."""
    from lamina.engine import Engine
    from lamina.gateway.protocol import parse_chat_request, resolve_sampling

    client, model = _client(stack), _model(stack)
    r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Tell me about Paris."}],
                                      response_format=_City, temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, _City)

    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France? Answer in JSON."}],
            "response_format": {"type": "json_object"}, "temperature": 0, "max_tokens": 40}
    r = client.chat.completions.create(**body, extra_body={"return_token_ids": True})
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"
    req = parse_chat_request(body)
    prompt = loaded_model.tokenizer.encode_chat(list(req.messages))
    (local,) = Engine(loaded_model).generate([prompt], resolve_sampling(req.sampling, len(prompt), 8192, None, "m"))
    assert r.choices[0].model_extra["token_ids"] == local.output_token_ids

    sampled = [client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Name a city."}], response_format=_City, temperature=1.0,
        seed=11, max_tokens=60).choices[0].message for _ in range(2)]
    assert sampled[0].content == sampled[1].content and sampled[0].parsed is not None
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model, messages=body["messages"], response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}})
    assert err.value.body["param"] == "response_format"


def test_tool_calls_with_the_clients_typed_parsing(stack):
    """A named tool_choice returns a tool call whose arguments validate against the schema
    (the client parses them into the pydantic type); "required", streamed, the same call
    in a tool_calls delta; tool_choice none answers in text."""
    client, model = _client(stack), _model(stack)
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(_City)]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.parse(model=model, messages=messages, tools=tools, temperature=0, max_tokens=60,
                                      tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None, message
    [call] = message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "GetWeather"
    parsed = call.function.parsed_arguments
    assert isinstance(parsed, GetWeather) and json.loads(call.function.arguments) == parsed.model_dump()
    streamed = [d for chunk in client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice="required", temperature=0, max_tokens=60,
        stream=True) for d in chunk.choices]
    calls = [t for d in streamed for t in (d.delta.tool_calls or [])]
    assert calls and calls[0].function.name == message.tool_calls[0].function.name
    assert json.loads(calls[0].function.arguments) == json.loads(message.tool_calls[0].function.arguments)
    assert streamed[-1].finish_reason == "tool_calls"
    r = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                       temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_responses_api_text_equals_the_chat_endpoints(stack):
    """Greedy, POST /v1/responses gives the chat endpoint's text for the same messages
    (`instructions` as the system message), created and streamed (`responses.stream`), and
    counts the same tokens; the repeated prompt's cached tokens are reported, fewer than its input."""
    client, model = _client(stack), _model(stack)
    system, prompt = "Answer briefly.", CHAT_PROMPTS[0]
    chat = client.chat.completions.create(model=model, max_tokens=MAX_TOKENS, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": prompt}])
    text, cut = chat.choices[0].message.content, chat.choices[0].finish_reason == "length"
    assert text
    r = client.responses.create(model=model, instructions=system, input=prompt, max_output_tokens=MAX_TOKENS,
                                temperature=0)
    assert r.output_text == text and r.status == ("incomplete" if cut else "completed")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    with client.responses.stream(model=model, instructions=system, input=[{"role": "user", "content": prompt}],
                                 max_output_tokens=MAX_TOKENS, temperature=0) as stream:
        events = list(stream)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    last = events[-1]
    assert last.type == ("response.incomplete" if cut else "response.completed") and last.response.output_text == text
    assert 0 <= last.response.usage.input_tokens_details.cached_tokens < last.response.usage.input_tokens


# --- lm-eval: log-likelihood scoring through the API (its local-completions model) ---------

LM_EVAL_TASK = "lamina_tiny_mc"
LM_EVAL_DOCS = [  # (question, choices, index of the right one): a few the model gets wrong
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("Water freezes at a temperature of zero degrees", ["Celsius", "Kelvin", "miles", "volts"], 0),
    ("The opposite of hot is", ["cold", "blue", "loud", "seven"], 0),
    ("The chemical symbol for gold is", ["Au", "Ag", "Gd", "Go"], 0),
    ("The square root of 144 is", ["12", "14", "72", "144"], 0),
    ("Bees make", ["honey", "bricks", "engines", "clouds"], 0),
    ("The year the Berlin Wall fell was", ["1989", "1961", "1991", "1979"], 0),
    ("The number of bones in an adult human body is", ["206", "212", "198", "300"], 0),
    ("def add(a, b):\n    return a", ["+ b", "* b", "- b", "/ b"], 0),
    ("The author of 'Pride and Prejudice' is", ["Jane Austen", "Charles Dickens", "Mark Twain", "Emily Bronte"], 0),
]


def _write_lm_eval_task(tmp_path) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in LM_EVAL_DOCS))
    (tmp_path / f"{LM_EVAL_TASK}.yaml").write_text(f"""task: {LM_EVAL_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {tmp_path / "datasets"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")


def _lm_eval(model: str, model_args: str, tasks) -> tuple[dict[int, list[float]], float]:
    """Each document's log-likelihood of each choice, and the accuracy."""
    import lm_eval

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[LM_EVAL_TASK], num_fewshot=0,
                                  batch_size=1, task_manager=tasks, log_samples=True)
    scores = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in out["samples"][LM_EVAL_TASK]}
    return scores, out["results"][LM_EVAL_TASK]["acc,none"]


@pytest.mark.slow
def test_lm_eval_log_likelihoods_through_the_api_equal_its_hf_model(stack, loaded_model, tmp_path, monkeypatch):
    """lm-eval's `local-completions` model through /v1/completions scores a small
    multiple-choice task as its own `hf` model does on the same checkpoint. The task is
    built here from local data (no hub is reachable): a JSONL file and a task YAML that
    loads it with the `json` dataset builder. Both models tokenize with the checkpoint's
    own tokenizer (the Hugging Face directory the GGUF is converted into), so they score
    the same token ids: each choice's log-likelihood must agree to 1e-3, and so must the
    accuracy."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[dev]')")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", api_key(stack))  # what local-completions sends
    _write_lm_eval_task(tmp_path)
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)  # ours alone: lm-eval's own take long
    checkpoint = loaded_model.weights_dir  # the Hugging Face directory of the stack's checkpoint
    served = _model(stack)
    api, api_acc = _lm_eval(
        "local-completions",
        f"model={served},base_url={stack.base_url}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={checkpoint},tokenized_requests=True,num_concurrent=1,max_retries=1", tasks)
    hf, hf_acc = _lm_eval("hf", f"pretrained={checkpoint},dtype=float32,device=cpu", tasks)
    assert sorted(api) == sorted(hf) == list(range(len(LM_EVAL_DOCS)))
    for doc in hf:
        assert len(api[doc]) == len(hf[doc]) == 4
        gap = max(abs(a - b) for a, b in zip(api[doc], hf[doc]))
        assert gap < 1e-3, (doc, api[doc], hf[doc])
    assert api_acc == hf_acc
    assert 0 < hf_acc < 1  # some right, some wrong: equal accuracies then say the rankings agree
    assert all(ll < 0 for lls in hf.values() for ll in lls)  # real scores, not zeros
