"""Sampling parameters and token log-probabilities: lamina.sampling's types <-> the control
plane's messages. One place, so the gateway's client, the scheduler and every sampling
service (prefill, model workers) read and write them alike; a service converts a message's
parameters once, where it receives them."""

from __future__ import annotations

from collections.abc import Sequence

from lamina.sampling.logprobs import TokenLogprobs
from lamina.sampling.params import SamplingParams
from lamina.sampling.penalties import needs_prompt, needs_state
from lamina.services.protos import lamina_pb2


def params_to_proto(sp: SamplingParams) -> lamina_pb2.SamplingParams:
    """The seed is 0 when the request has none (GenerateRequest.has_seed says which)."""
    return lamina_pb2.SamplingParams(
        max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
        seed=sp.seed or 0, stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
        logprobs=sp.logprobs is not None, top_logprobs=sp.logprobs or 0,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, min_tokens=sp.min_tokens, logit_bias=dict(sp.logit_bias),
        grammar=sp.grammar or "")


def params_from_proto(p: lamina_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(max_tokens=max(1, p.max_tokens), temperature=p.temperature, top_p=p.top_p or 1.0,
                          top_k=p.top_k, seed=p.seed, stop_token_ids=tuple(p.stop_token_ids),
                          ignore_eos=p.ignore_eos, logprobs=p.top_logprobs if p.logprobs else None,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty or 1.0,
                          min_tokens=min(p.min_tokens, max(1, p.max_tokens)),
                          logit_bias=tuple(sorted(p.logit_bias.items())), grammar=p.grammar or None)


def logprobs_to_proto(lp: TokenLogprobs) -> lamina_pb2.Logprobs:
    return lamina_pb2.Logprobs(logprob=lp.logprob, top=[lamina_pb2.Logprobs.Top(token_id=t, logprob=v)
                                                        for t, v in lp.top])


def logprobs_from_proto(token_id: int, p: lamina_pb2.Logprobs) -> TokenLogprobs:
    return TokenLogprobs(token_id, p.logprob, tuple((t.token_id, t.logprob) for t in p.top))


def logprobs_of(msg: lamina_pb2.PrefillResult | lamina_pb2.DecodeToken) -> lamina_pb2.Logprobs | None:
    """The token's log-probabilities, or None when its request did not ask for them."""
    return msg.logprobs if msg.HasField("logprobs") else None


def join_history(params: lamina_pb2.SamplingParams, prompt_ids: Sequence[int],
                 output_ids: Sequence[int]) -> dict[str, list[int]]:
    """The StepSequence fields a joining sequence's penalties and grammar need (none for
    most): its model worker rebuilds the sequence's PenaltyState and GrammarState from
    them, so a sequence that moves (a rebuild, another worker) samples as it would have
    where it was."""
    sp = params_from_proto(params)
    if not needs_state(sp) and sp.grammar is None:
        return {}
    fields = {"output_token_ids": list(output_ids)}
    if needs_prompt(sp):
        fields["prompt_token_ids"] = list(prompt_ids)
    return fields
