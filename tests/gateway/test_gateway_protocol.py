"""OpenAI request JSON -> typed requests: accepted shapes and exact errors."""

from __future__ import annotations

import pytest

from lamina.gateway.protocol import (
    MAX_STOP_STRINGS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    SamplingParams,
    check_token_ids,
    parse_chat_request,
    parse_completion_request,
    resolve_sampling,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": "m", "messages": USER, **fields}


def error_of(fn, body) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(body)
    return info.value


def test_minimal_chat_request_has_openai_defaults():
    req = parse_chat_request(chat())
    assert req == ChatRequest("m", ({"role": "user", "content": "hi"},), False, False, SamplingFields())


def test_chat_request_with_every_supported_field():
    req = parse_chat_request(chat(
        stream=True, stream_options={"include_usage": True}, max_tokens=7, temperature=0, top_p=0.5,
        top_k=40, seed=3, stop="\n", n=1, stop_token_ids=[5], ignore_eos=True, user="u",
        presence_penalty=0, logprobs=False, modalities=["text"], safety_identifier="s", prompt_cache_key="k"))
    assert req.stream and req.include_usage
    assert req.sampling == SamplingFields(max_tokens=7, temperature=0.0, top_p=0.5, top_k=40, seed=3,
                                          stop=("\n",), stop_token_ids=(5,), ignore_eos=True)


def test_max_completion_tokens_replaces_max_tokens():
    s = parse_chat_request(chat(max_tokens=100, max_completion_tokens=5)).sampling
    assert (s.max_tokens, s.max_tokens_param) == (5, "max_completion_tokens")


def test_content_parts_are_joined_and_assistant_content_may_be_null():
    req = parse_chat_request(chat(messages=[
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "c"},
    ]))
    assert [m["content"] for m in req.messages] == ["ab", "", "c"]


def test_stop_list_is_deduplicated_in_order():
    assert parse_chat_request(chat(stop=["b", "a", "b"])).sampling.stop == ("b", "a")


def test_continuous_usage_stats_counts_only_with_include_usage():
    req = parse_chat_request(chat(stream=True, stream_options={"include_usage": True,
                                                               "continuous_usage_stats": True}))
    assert (req.include_usage, req.continuous_usage) == (True, True)
    req = parse_completion_request({"model": "m", "prompt": "x", "stream": True,
                                    "stream_options": {"continuous_usage_stats": True}})
    assert (req.include_usage, req.continuous_usage) == (False, False)  # as vLLM: needs include_usage


def test_vllm_extensions_are_accepted_at_what_the_server_does():
    req = parse_chat_request(chat(skip_special_tokens=True, spaces_between_special_tokens=True,
                                  include_stop_str_in_output=False, min_p=0, use_beam_search=False,
                                  length_penalty=1.0))
    assert req.sampling == SamplingFields()


@pytest.mark.parametrize("parse, body", [(parse_chat_request, chat()),
                                         (parse_completion_request, {"model": "m", "prompt": "x"})])
def test_vllm_output_options_reach_the_sampling_params(parse, body):
    fields = parse({**body, "skip_special_tokens": False, "include_stop_str_in_output": True}).sampling
    assert (fields.skip_special_tokens, fields.include_stop_str_in_output) == (False, True)
    sp = resolve_sampling(fields, 3, 100, None, "prompt")
    assert (sp.skip_special_tokens, sp.include_stop_str_in_output) == (False, True)


def test_logprobs_fields():
    assert parse_chat_request(chat()).sampling.logprobs is None
    assert parse_chat_request(chat(logprobs=False, top_logprobs=0)).sampling.logprobs is None
    assert parse_chat_request(chat(logprobs=True)).sampling.logprobs == 0
    assert parse_chat_request(chat(logprobs=True, top_logprobs=4)).sampling.logprobs == 4
    assert parse_completion_request({"model": "m", "prompt": "x", "logprobs": 3}).sampling.logprobs == 3
    assert parse_completion_request({"model": "m", "prompt": "x", "logprobs": 0}).sampling.logprobs == 0
    err = error_of(parse_completion_request, {"model": "m", "prompt": "x", "logprobs": True})
    assert (err.param, err.code) == ("logprobs", "invalid_type")
    sp = resolve_sampling(parse_chat_request(chat(logprobs=True, top_logprobs=2)).sampling, 3, 100, None,
                          "messages")
    assert sp.logprobs == 2


def test_penalties_and_biases():
    f = parse_chat_request(chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_tokens=3,
                                logit_bias={"17": -100, "3": 2.5})).sampling
    assert (f.presence_penalty, f.frequency_penalty, f.repetition_penalty, f.min_tokens, f.logit_bias) == (
        0.5, -1.0, 1.2, 3, ((3, 2.5), (17, -100.0)))
    sp = resolve_sampling(f, 3, 100, None, "messages")
    assert (sp.presence_penalty, sp.min_tokens, sp.logit_bias) == (0.5, 3, ((3, 2.5), (17, -100.0)))
    err = error_of(lambda b: resolve_sampling(parse_chat_request(b).sampling, 3, 100, None, "messages"),
                   chat(min_tokens=8, max_tokens=5))
    assert (err.param, err.message) == ("min_tokens", "Invalid value for 'min_tokens': must be at most max_tokens "
                                                      "(5), got 8.")


def test_echo_and_max_tokens_zero():
    req = parse_completion_request({"model": "m", "prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 1})
    assert (req.echo, req.prompt_only, req.sampling.max_tokens) == (True, True, 1)
    req = parse_completion_request({"model": "m", "prompt": "x", "echo": True, "max_tokens": 3})
    assert (req.echo, req.prompt_only, req.sampling.max_tokens) == (True, False, 3)
    err = error_of(parse_completion_request, {"model": "m", "prompt": "x", "max_tokens": 0})
    assert (err.param, err.code) == ("max_tokens", "invalid_value")
    err = error_of(parse_completion_request, {"model": "m", "prompt": "x", "echo": True, "stream": True})
    assert (err.param, err.message) == ("echo", "Invalid value for 'echo': the prompt is echoed only when "
                                                "'stream' is false.")


def test_top_k_minus_one_means_no_top_k():
    assert parse_chat_request(chat(top_k=-1)).sampling.top_k == 0


@pytest.mark.parametrize("body, message, param, code", [
    ([1], "The request body must be a JSON object, but got an array.", None, None),
    ({"messages": USER}, "Missing required parameter: 'model'.", "model", "missing_required_parameter"),
    (chat(model=3), "Invalid type for 'model': expected a string, but got an integer instead.", "model",
     "invalid_type"),
    ({"model": "m"}, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter"),
    (chat(messages="hi"), "Invalid type for 'messages': expected an array, but got a string instead.", "messages",
     "invalid_type"),
    (chat(messages=[]), "Invalid value for 'messages': expected at least one message.", "messages", "invalid_value"),
    (chat(messages=[{"role": "user", "content": 5}]),
     "Invalid type for 'messages[0].content': expected a string or an array of content parts, but got an integer "
     "instead.", "messages[0].content", "invalid_type"),
    (chat(messages=[{"role": "user"}]), "Missing required parameter: 'messages[0].content'.",
     "messages[0].content", "missing_required_parameter"),
    (chat(messages=[{"role": "wizard", "content": "x"}]),
     "Invalid value for 'messages[0].role': must be one of assistant, developer, system, tool, user; got 'wizard'.",
     "messages[0].role", "invalid_value"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "Invalid value for 'messages[0].content[0].type': only 'text' content parts are supported, got 'image_url'.",
     "messages[0].content[0].type", "invalid_value"),
    (chat(max_tokens="5"), "Invalid type for 'max_tokens': expected an integer, but got a string instead.",
     "max_tokens", "invalid_type"),
    (chat(max_tokens=2.5), "Invalid type for 'max_tokens': expected an integer, but got a number instead.",
     "max_tokens", "invalid_type"),
    (chat(max_tokens=True), "Invalid type for 'max_tokens': expected an integer, but got a boolean instead.",
     "max_tokens", "invalid_type"),
    (chat(max_tokens=0), "Invalid value for 'max_tokens': must be at least 1, got 0.", "max_tokens", "invalid_value"),
    (chat(max_completion_tokens=-2), "Invalid value for 'max_completion_tokens': must be at least 1, got -2.",
     "max_completion_tokens", "invalid_value"),
    (chat(temperature="hot"), "Invalid type for 'temperature': expected a number, but got a string instead.",
     "temperature", "invalid_type"),
    (chat(temperature=2.5), "Invalid value for 'temperature': must be in [0, 2], got 2.5.", "temperature",
     "invalid_value"),
    (chat(top_p=0), "Invalid value for 'top_p': must be in (0, 1], got 0.", "top_p", "invalid_value"),
    (chat(top_k=-5), "Invalid value for 'top_k': must be at least -1, got -5.", "top_k", "invalid_value"),
    (chat(seed="1"), "Invalid type for 'seed': expected an integer, but got a string instead.", "seed",
     "invalid_type"),
    (chat(n=17), "Invalid value for 'n': must be at most 16, got 17.", "n", "invalid_value"),
    (chat(stream="yes"), "Invalid type for 'stream': expected a boolean, but got a string instead.", "stream",
     "invalid_type"),
    (chat(stream_options={"include_usage": True}),
     "The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options", None),
    (chat(stream=True, stream_options={"include_usage": 1}),
     "Invalid type for 'stream_options.include_usage': expected a boolean, but got an integer instead.",
     "stream_options.include_usage", "invalid_type"),
    (chat(stream=True, stream_options={"x": 1}), "Unrecognized request argument supplied: stream_options.x",
     "stream_options.x", "unknown_parameter"),
    (chat(stop=5), "Invalid type for 'stop': expected a string or an array of strings, but got an integer instead.",
     "stop", "invalid_type"),
    (chat(stop=["a", 1]), "Invalid type for 'stop[1]': expected a string, but got an integer instead.", "stop[1]",
     "invalid_type"),
    (chat(stop=[""]), "Invalid value for 'stop[0]': stop strings must not be empty.", "stop[0]", "invalid_value"),
    (chat(stop=["x"] * (MAX_STOP_STRINGS + 1)),
     f"Invalid value for 'stop': at most {MAX_STOP_STRINGS} stop strings are supported, got {MAX_STOP_STRINGS + 1}.",
     "stop", "invalid_value"),
    (chat(stop_token_ids=[1, "2"]),
     "Invalid type for 'stop_token_ids[1]': expected an integer, but got a string instead.", "stop_token_ids[1]",
     "invalid_type"),
    (chat(frobnicate=1), "Unrecognized request argument supplied: frobnicate", "frobnicate", "unknown_parameter"),
    (chat(presence_penalty=2.5), "Invalid value for 'presence_penalty': must be in [-2, 2], got 2.5.",
     "presence_penalty", "invalid_value"),
    (chat(repetition_penalty=0), "Invalid value for 'repetition_penalty': must be in (0, 2], got 0.",
     "repetition_penalty", "invalid_value"),
    (chat(min_tokens=-1), "Invalid value for 'min_tokens': must be at least 0, got -1.", "min_tokens",
     "invalid_value"),
    (chat(logit_bias=[1]), "Invalid type for 'logit_bias': expected an object, but got an array instead.",
     "logit_bias", "invalid_type"),
    (chat(logit_bias={"x": 1}), "Invalid value for 'logit_bias': keys are token ids written as decimal strings, "
     "got 'x'.", "logit_bias", "invalid_value"),
    (chat(logit_bias={"5": 101}), "Invalid value for 'logit_bias.5': must be in [-100, 100], got 101.",
     "logit_bias.5", "invalid_value"),
    (chat(logit_bias={"5": "1"}), "Invalid type for 'logit_bias.5': expected a number, but got a string instead.",
     "logit_bias.5", "invalid_type"),
    (chat(top_logprobs=2), "Invalid value for 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is used.",
     "top_logprobs", "invalid_value"),
    (chat(logprobs=True, top_logprobs=21), "Invalid value for 'top_logprobs': must be at most 20, got 21.",
     "top_logprobs", "invalid_value"),
    (chat(logprobs=1), "Invalid type for 'logprobs': expected a boolean, but got an integer instead.",
     "logprobs", "invalid_type"),
    (chat(prompt="x"), "Unrecognized request argument supplied: prompt", "prompt", "unknown_parameter"),
    (chat(stream=True, stream_options={"continuous_usage_stats": "y"}),
     "Invalid type for 'stream_options.continuous_usage_stats': expected a boolean, but got a string instead.",
     "stream_options.continuous_usage_stats", "invalid_type"),
    (chat(min_p=0.1), "'min_p' is not supported by this server; omit it or leave it at its default.", "min_p",
     "unsupported_parameter"),
    (chat(modalities=["text", "audio"]),
     "'modalities' is not supported by this server; omit it or leave it at its default.", "modalities",
     "unsupported_parameter"),
    (chat(spaces_between_special_tokens=False),
     "'spaces_between_special_tokens' is not supported by this server; omit it or leave it at its default.",
     "spaces_between_special_tokens", "unsupported_parameter"),
    (chat(include_stop_str_in_output="yes"),
     "Invalid type for 'include_stop_str_in_output': expected a boolean, but got a string instead.",
     "include_stop_str_in_output", "invalid_type"),
    (chat(skip_special_tokens=0),
     "Invalid type for 'skip_special_tokens': expected a boolean, but got an integer instead.",
     "skip_special_tokens", "invalid_type"),
])
def test_chat_request_errors(body, message, param, code):
    err = error_of(parse_chat_request, body)
    assert err.status == 400
    assert err.body() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                    "code": code}}


def test_completion_prompt_forms():
    assert parse_completion_request({"model": "m", "prompt": "hi"}).prompt == "hi"
    assert parse_completion_request({"model": "m", "prompt": [1, 2]}).prompt == (1, 2)
    assert parse_completion_request({"model": "m", "prompt": ["hi"]}).prompt == "hi"
    assert parse_completion_request({"model": "m", "prompt": [[3, 4]]}).prompt == (3, 4)
    req = parse_completion_request({"model": "m", "prompt": "x", "max_tokens": 3, "echo": False, "best_of": 1})
    assert req == CompletionRequest("m", "x", False, False, SamplingFields(max_tokens=3))


@pytest.mark.parametrize("body, message, param", [
    ({"model": "m"}, "Missing required parameter: 'prompt'.", "prompt"),
    ({"model": "m", "prompt": ""}, "Invalid value for 'prompt': the prompt must not be empty.", "prompt"),
    ({"model": "m", "prompt": []}, "Invalid value for 'prompt': the prompt must not be empty.", "prompt"),
    ({"model": "m", "prompt": ["a", "b"]},
     "Invalid value for 'prompt': batched prompts are not supported; send one prompt per request (got 2).", "prompt"),
    ({"model": "m", "prompt": [1, "a"]},
     "Invalid type for 'prompt': expected a string or an array of token ids, but got an array instead.", "prompt"),
    ({"model": "m", "prompt": 5},
     "Invalid type for 'prompt': expected a string or an array of token ids, but got an integer instead.", "prompt"),
    ({"model": "m", "prompt": "x", "suffix": "y"},
     "'suffix' is not supported by this server; omit it or leave it at its default.", "suffix"),
    ({"model": "m", "prompt": "x", "max_completion_tokens": 3},
     "Unrecognized request argument supplied: max_completion_tokens", "max_completion_tokens"),
])
def test_completion_request_errors(body, message, param):
    err = error_of(parse_completion_request, body)
    assert (err.status, err.message, err.param) == (400, message, param)


def test_token_ids_must_be_in_the_vocabulary():
    check_token_ids((0, 9), 10)
    with pytest.raises(ApiError) as info:
        check_token_ids((0, 10), 10)
    assert info.value.message == "Invalid value for 'prompt[1]': token id 10 is outside the vocabulary [0, 10)."
    assert info.value.param == "prompt[1]"


def test_resolve_sampling_fills_the_context_when_max_tokens_is_absent():
    assert resolve_sampling(SamplingFields(), 100, 512, None, "messages").max_tokens == 412
    assert resolve_sampling(SamplingFields(), 100, 512, 16, "prompt").max_tokens == 16
    assert resolve_sampling(SamplingFields(), 500, 512, 16, "prompt").max_tokens == 12  # clamped to fit
    params = resolve_sampling(SamplingFields(max_tokens=12, temperature=0.0, top_k=5, stop=("x",)), 500, 512, None,
                              "messages")
    assert params == SamplingParams(temperature=0.0, top_k=5, max_tokens=12, stop=("x",))


def test_prompt_that_fills_the_context_is_refused():
    with pytest.raises(ApiError) as info:
        resolve_sampling(SamplingFields(), 512, 512, None, "messages")
    err = info.value
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")
    assert err.message == ("This model's maximum context length is 512 tokens. However, your messages resulted in "
                           "512 tokens, which leaves no room for a completion. Please reduce the length of the "
                           "messages.")


def test_explicit_max_tokens_past_the_context_is_refused_not_clamped():
    with pytest.raises(ApiError) as info:
        resolve_sampling(SamplingFields(max_tokens=13, max_tokens_param="max_completion_tokens"), 500, 512, None,
                         "messages")
    err = info.value
    assert (err.status, err.param, err.code) == (400, "max_completion_tokens", "context_length_exceeded")
    assert err.message == ("This model's maximum context length is 512 tokens. However, you requested 513 tokens "
                           "(500 in the messages, 13 in the completion). Please reduce the length of the messages "
                           "or completion.")


def test_sampling_params_validate_themselves():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams().is_greedy
