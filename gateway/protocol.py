"""Typed requests for the backend, and OpenAI request JSON -> typed, with validation.

Everything here is a pure function of its arguments: no I/O, no tokenizer. The
handler parses the JSON body with `parse_chat_request` / `parse_completion_request`,
tokenizes the prompt, then calls `resolve_sampling` with the prompt's length to
check the context window and build the `SamplingParams` the backend receives.

Validation failures raise `ApiError`, which carries the HTTP status and the
fields of OpenAI's error body (`message`, `type`, `param`, `code`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from lamina.gateway.structured import FieldError, StructuredOutput, ToolUse, parse_history_calls, parse_structured
from lamina.gateway.tool_calls import history_content, with_tools

# The sampling parameters are lamina.sampling's own type: one definition for every layer.
from lamina.sampling.logprobs import MAX_TOP_LOGPROBS, TokenLogprobs
from lamina.sampling.params import SamplingParams

# Per request; bounds the cost of stop-string matching on every token.
MAX_STOP_STRINGS = 16
# Per request; bounds the work logit_bias adds to every sampled token.
MAX_LOGIT_BIAS = 1024
# Larger top_k values keep every token, as 0 does; the bound keeps them in the wire's 32 bits.
MAX_TOP_K = (1 << 31) - 1
# Choices per request (`n`): each is a sequence of the decode batch.
MAX_CHOICES = 16
# Returned when the backend has no explicit `max_tokens` from a completions request (OpenAI's default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})

FinishReason = Literal["stop", "length"]


# --- typed messages: gateway <-> backend ------------------------------------


@dataclass(frozen=True)
class GenerateRequest:
    """One request as the backend sees it. `arrival_time` is wall-clock (time.time())."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float
    tool_use: ToolUse | None = None  # its output may hold tool calls (gateway/tool_calls.py parses them)
    prompt_logprobs: bool = False  # the prompt's tokens' logprobs too (echo), sampling.logprobs alternatives
    n: int = 1  # choices, sampled independently from the prompt (the backend derives each one's seed)


@dataclass
class TokenEvent:
    """Tokens the backend produced since its last event; `finish_reason` set on the last one.

    A backend reports "stop" when it stopped on EOS or a stop token id (that token
    is included in `token_ids`), "length" when `max_tokens` was reached. Any other
    finish reason (e.g. "abort") means the backend gave up on the request.
    `logprobs`: one per token id when the request asked for them (`sampling.logprobs`).
    """

    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With the first token, when GenerateRequest.prompt_logprobs: prompt tokens 1.. in order.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    index: int = 0  # the choice (of GenerateRequest.n) these tokens and this finish reason belong to
    # Prompt tokens the prefix cache served (not computed), on the request's first event
    # from a backend that knows; None elsewhere.
    cached_tokens: int | None = None


# --- errors -----------------------------------------------------------------


class ApiError(Exception):
    """A request the gateway refuses, with OpenAI's error fields and an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# --- OpenAI JSON -> typed ---------------------------------------------------


@dataclass(frozen=True)
class SamplingFields:
    """Sampling fields as the client sent them; `max_tokens` None means "as many as fit"."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # which field set it, for error messages
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # extension (vLLM)
    min_tokens: int = 0  # extension (vLLM)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), in id order
    grammar: str | None = None  # response_format's or the tools' (gateway/structured.py)
    skip_special_tokens: bool = True  # extension (vLLM)
    include_stop_str_in_output: bool = False  # extension (vLLM)


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[dict[str, str], ...]  # {"role", "content"} with content flattened to text
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingFields = field(default_factory=SamplingFields)
    return_token_ids: bool = False  # extension: the generated ids beside the text
    continuous_usage: bool = False  # extension (vLLM): usage so far in every streamed chunk
    n: int = 1  # choices
    tool_use: ToolUse | None = None  # (`messages` then open with the tools' system prompt)


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids sent as they are
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingFields = field(default_factory=SamplingFields)
    return_token_ids: bool = False  # extension: the generated ids beside the text
    continuous_usage: bool = False  # extension (vLLM): usage so far in every streamed chunk
    echo: bool = False  # the prompt before the completion (and its tokens' logprobs, with logprobs)
    prompt_only: bool = False  # echo with max_tokens 0: the prompt alone, nothing generated
    n: int = 1  # choices


# Fields that every OpenAI client may send, accepted only at their "off" value;
# anything else is refused rather than silently ignored.
_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "best_of": (1,),
    "suffix": ("",),
    "modalities": (["text"],),  # chat: text out is what every model here makes; audio is refused
}
# vLLM's extensions that load generators and evaluation tools send: accepted at the value
# that says what this server always does (the tokenizer's own spacing of special tokens,
# no min-p, no beam search), refused (naming the field) otherwise.
_EXTENSION_OFF_VALUES: dict[str, tuple[Any, ...]] = {
    "spaces_between_special_tokens": (True,),
    "min_p": (0, 0.0),
    "use_beam_search": (False,),
    "length_penalty": (1, 1.0),
}
_OFF_VALUES.update(_EXTENSION_OFF_VALUES)
# Accepted and ignored: they do not change the output.
_IGNORED = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"})

_COMMON = frozenset(
    {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "seed", "stop",
     "top_k", "stop_token_ids", "ignore_eos", "return_token_ids", "presence_penalty", "frequency_penalty",
     "logit_bias", "repetition_penalty", "min_tokens", "skip_special_tokens", "include_stop_str_in_output"}
) | frozenset(_EXTENSION_OFF_VALUES)
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"} | _IGNORED | {
    "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "logit_bias", "tools",
    "tool_choice", "response_format", "parallel_tool_calls", "modalities"}
_COMPLETION_FIELDS = _COMMON | {"prompt"} | _IGNORED | {
    "presence_penalty", "frequency_penalty", "logprobs", "logit_bias", "best_of", "echo", "suffix"}


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number" if math.isfinite(value) else "a number that is not finite"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def wrong_type(param: str, expected: str, value: Any) -> ApiError:
    return invalid(f"Invalid type for '{param}': expected {expected}, but got {type_name(value)} instead.",
                   param, "invalid_type")


def bad_value(param: str, reason: str) -> ApiError:
    return invalid(f"Invalid value for '{param}': {reason}", param, "invalid_value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    # (an int is finite however large, and too large for math.isfinite)
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def get_bool(body: dict[str, Any], name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wrong_type(prefix + name, "a boolean", value)
    return value


def _get_number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise wrong_type(name, "a number", value)
    if value > hi or value < lo or (lo_open and value == lo):
        bracket = "(" if lo_open else "["
        raise bad_value(name, f"must be in {bracket}{lo:g}, {hi:g}], got {value}.")
    return float(value)


def _get_int(body: dict[str, Any], name: str, minimum: int | None = None, maximum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise wrong_type(name, "an integer", value)
    if minimum is not None and value < minimum:
        raise bad_value(name, f"must be at least {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise bad_value(name, f"must be at most {maximum}, got {value}.")
    return value


def _get_seed(body: dict[str, Any]) -> int | None:
    """A 64-bit seed, signed or not; negative ones are taken modulo 2**64 (the same samples
    wherever the seed is used: every use reduces it modulo 2**63)."""
    seed = _get_int(body, "seed", minimum=-(1 << 63), maximum=(1 << 64) - 1)
    return None if seed is None else seed % (1 << 64)


def check_text(text: str, param: str) -> str:
    """`text`, if it is valid Unicode: JSON's \\u escapes can spell an unpaired surrogate,
    which no tokenizer (or UTF-8) takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad_value(param, f"the text holds an unpaired surrogate (\\u{ord(text[exc.start]):04x} at "
                                f"position {exc.start}).") from None
    return text


def _check_fields(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for name, value in body.items():
        if name not in allowed:
            raise invalid(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
        if value is not None and name in _OFF_VALUES and value not in _OFF_VALUES[name]:
            raise invalid(f"'{name}' is not supported by this server; omit it or leave it at its default.",
                          name, "unsupported_parameter")


def parse_model(body: dict[str, Any]) -> str:
    if "model" not in body or body["model"] is None:
        raise invalid("Missing required parameter: 'model'.", "model", "missing_required_parameter")
    model = body["model"]
    if not isinstance(model, str):
        raise wrong_type("model", "a string", model)
    return model


def _parse_stream(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage). `continuous_usage_stats` (vLLM's extension,
    sent by guidellm) counts only with `include_usage`, as in vLLM."""
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object", options)
    if not stream:
        raise invalid("The 'stream_options' parameter is only allowed when 'stream' is enabled.", "stream_options")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise invalid(f"Unrecognized request argument supplied: stream_options.{key}",
                          f"stream_options.{key}", "unknown_parameter")
    include = get_bool(options, "include_usage", False, "stream_options.")
    continuous = get_bool(options, "continuous_usage_stats", False, "stream_options.")
    return stream, include, include and continuous


def _parse_stop(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise wrong_type("stop", "a string or an array of strings", value)
    if len(value) > MAX_STOP_STRINGS:
        raise bad_value("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(value)}.")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise wrong_type(f"stop[{i}]", "a string", s)
        if not s:
            raise bad_value(f"stop[{i}]", "stop strings must not be empty.")
        check_text(s, f"stop[{i}]")
    return tuple(dict.fromkeys(value))


def _parse_chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (bool) and `top_logprobs` (alternatives, with logprobs only)."""
    wanted = get_bool(body, "logprobs", False)
    top = _get_int(body, "top_logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)
    if top and not wanted:
        raise bad_value("top_logprobs", "'logprobs' must be true when 'top_logprobs' is used.")
    return (top or 0) if wanted else None


def _parse_completion_logprobs(body: dict[str, Any]) -> int | None:
    """Completions' `logprobs`: how many alternatives per token (0: the sampled token's alone)."""
    return _get_int(body, "logprobs", minimum=0, maximum=MAX_TOP_LOGPROBS)


def _parse_logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: {"token id": bias in [-100, 100]}; ids are checked against
    the vocabulary by the handler (`_check_sampling_ids`)."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise wrong_type("logit_bias", "an object", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_value("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(value)}.")
    out = {}
    for key, bias in value.items():
        param = f"logit_bias.{key}"
        if not (key.isascii() and key.isdigit()):
            raise bad_value("logit_bias", f"keys are token ids written as decimal strings, got {key!r}.")
        if not _is_number(bias):
            raise wrong_type(param, "a number", bias)
        if not -100 <= bias <= 100:
            raise bad_value(param, f"must be in [-100, 100], got {bias}.")
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


def parse_sampling(body: dict[str, Any], max_tokens_fields: tuple[str, ...],
                    logprobs: int | None = None) -> SamplingFields:
    # The later field in `max_tokens_fields` wins (max_completion_tokens replaces max_tokens).
    max_tokens, max_tokens_param = None, "max_tokens"
    for name in max_tokens_fields:
        value = _get_int(body, name, minimum=1)
        if value is not None:
            max_tokens, max_tokens_param = value, name
    top_k = _get_int(body, "top_k", minimum=-1, maximum=MAX_TOP_K)
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None:
        stop_token_ids = []
    if not isinstance(stop_token_ids, list):
        raise wrong_type("stop_token_ids", "an array of integers", stop_token_ids)
    for i, t in enumerate(stop_token_ids):
        if not _is_int(t):
            raise wrong_type(f"stop_token_ids[{i}]", "an integer", t)
        if t < 0:
            raise bad_value(f"stop_token_ids[{i}]", f"token ids are non-negative, got {t}.")
    return SamplingFields(
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        temperature=_get_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_get_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=0 if top_k is None or top_k == -1 else top_k,  # -1 and 0: no top-k (vLLM's convention)
        seed=_get_seed(body),
        stop=_parse_stop(body),
        stop_token_ids=tuple(stop_token_ids),
        ignore_eos=get_bool(body, "ignore_eos", False),
        logprobs=logprobs,
        presence_penalty=_get_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_get_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_get_number(body, "repetition_penalty", 1.0, 0.0, 2.0, lo_open=True),
        min_tokens=_get_int(body, "min_tokens", minimum=0) or 0,
        logit_bias=_parse_logit_bias(body),
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
    )


def _parse_n(body: dict[str, Any]) -> int:
    return _get_int(body, "n", minimum=1, maximum=MAX_CHOICES) or 1


def require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise invalid(f"The request body must be a JSON object, but got {type_name(body)}.")
    return body


def _parse_content(content: Any, param: str, role: str) -> str:
    if isinstance(content, str):
        return check_text(content, param)
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise wrong_type(f"{param}[{i}]", "an object", part)
            if part.get("type") != "text":
                raise bad_value(f"{param}[{i}].type",
                                 f"only 'text' content parts are supported, got {part.get('type')!r}.")
            text = part.get("text")
            if not isinstance(text, str):
                raise wrong_type(f"{param}[{i}].text", "a string", text)
            texts.append(check_text(text, f"{param}[{i}].text"))
        return "".join(texts)
    raise wrong_type(param, "a string or an array of content parts", content)


def _parse_messages(body: dict[str, Any]) -> tuple[dict[str, str], ...]:
    if "messages" not in body or body["messages"] is None:
        raise invalid("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
    messages = body["messages"]
    if not isinstance(messages, list):
        raise wrong_type("messages", "an array", messages)
    if not messages:
        raise bad_value("messages", "expected at least one message.")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise wrong_type(f"messages[{i}]", "an object", msg)
        role = msg.get("role")
        if not isinstance(role, str):
            raise wrong_type(f"messages[{i}].role", "a string", role)
        if role not in CHAT_ROLES:
            raise bad_value(f"messages[{i}].role", f"must be one of {', '.join(sorted(CHAT_ROLES))}; got {role!r}.")
        if "content" not in msg and role != "assistant":
            raise invalid(f"Missing required parameter: 'messages[{i}].content'.", f"messages[{i}].content",
                          "missing_required_parameter")
        content = _parse_content(msg.get("content"), f"messages[{i}].content", role)
        calls = _field_errors(parse_history_calls, msg.get("tool_calls") if role == "assistant" else None,
                              f"messages[{i}].tool_calls")
        out.append(history_content(role, content, calls))
    return tuple(out)


def _field_errors(parse: Any, *args: Any) -> Any:
    """`parse(*args)`, its FieldError a 400."""
    try:
        return parse(*args)
    except FieldError as exc:
        raise invalid(exc.message, exc.param, exc.code) from None


def _parse_structured(body: dict[str, Any], sampling: SamplingFields) -> StructuredOutput:
    structured: StructuredOutput = _field_errors(parse_structured, body)
    if structured.grammar is not None:
        # The grammar decides where EOS may come; these would hold it back.
        for name, value in (("ignore_eos", sampling.ignore_eos), ("min_tokens", sampling.min_tokens)):
            if value:
                raise bad_value(name, "it cannot be combined with 'response_format' or 'tools'.")
    return structured


def parse_chat_request(body: Any) -> ChatRequest:
    """Validate a decoded `/v1/chat/completions` JSON body."""
    body = require_object(body)
    _check_fields(body, _CHAT_FIELDS)
    model = parse_model(body)
    messages = _parse_messages(body)
    stream, include_usage, continuous_usage = _parse_stream(body)
    sampling = parse_sampling(body, ("max_tokens", "max_completion_tokens"), _parse_chat_logprobs(body))
    structured = _parse_structured(body, sampling)
    if structured.tool_use is not None:
        messages = with_tools(messages, structured.tool_use.system_prompt)
    sampling = dataclasses.replace(sampling, grammar=structured.grammar)
    return ChatRequest(model, messages, stream, include_usage, sampling,
                       get_bool(body, "return_token_ids", False),
                       continuous_usage, _parse_n(body), structured.tool_use)


def _parse_prompt(body: dict[str, Any]) -> str | tuple[int, ...]:
    if "prompt" not in body or body["prompt"] is None:
        raise invalid("Missing required parameter: 'prompt'.", "prompt", "missing_required_parameter")
    prompt = body["prompt"]
    # One prompt wrapped in a list ([text] or [[ids]]) is the same prompt; more is a batch.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_value("prompt", "the prompt must not be empty.")
        return check_text(prompt, "prompt")
    if isinstance(prompt, list):
        if not prompt:
            raise bad_value("prompt", "the prompt must not be empty.")
        if all(_is_int(t) for t in prompt):
            return tuple(prompt)
        if all(isinstance(p, (str, list)) for p in prompt):
            raise bad_value("prompt", "batched prompts are not supported; send one prompt per request "
                                       f"(got {len(prompt)}).")
        raise wrong_type("prompt", "a string or an array of token ids", prompt)
    raise wrong_type("prompt", "a string or an array of token ids", prompt)


def parse_completion_request(body: Any) -> CompletionRequest:
    """Validate a decoded `/v1/completions` JSON body."""
    body = require_object(body)
    _check_fields(body, _COMPLETION_FIELDS)
    model = parse_model(body)
    prompt = _parse_prompt(body)
    stream, include_usage, continuous_usage = _parse_stream(body)
    echo = get_bool(body, "echo", False)
    if echo and stream:
        raise bad_value("echo", "the prompt is echoed only when 'stream' is false.")
    # With echo, max_tokens 0 asks for the prompt alone (log-likelihood scoring); the
    # backend still runs one step, whose token is not returned.
    prompt_only = echo and _is_int(body.get("max_tokens")) and body["max_tokens"] == 0
    if prompt_only:
        body = {**body, "max_tokens": 1}
    sampling = parse_sampling(body, ("max_tokens",), _parse_completion_logprobs(body))
    return CompletionRequest(model, prompt, stream, include_usage, sampling,
                             get_bool(body, "return_token_ids", False),
                             continuous_usage, echo, prompt_only, _parse_n(body))


def check_token_ids(ids: tuple[int, ...], vocab_size: int, param: str = "prompt", keyed: bool = False) -> None:
    """Every id inside the vocabulary; the first outside it named `param[i]` by its position,
    or `param.ID` where the ids are an object's keys (`keyed`: logit_bias, whose values are
    named so too)."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise bad_value(f"{param}.{t}" if keyed else f"{param}[{i}]",
                            f"token id {t} is outside the vocabulary [0, {vocab_size}).")


def resolve_sampling(
    fields: SamplingFields,
    num_prompt_tokens: int,
    context_length: int,
    default_max_tokens: int | None,
    prompt_param: str,
) -> SamplingParams:
    """Check the context window and fix `max_tokens`.

    A prompt that leaves no room for one generated token is refused. An explicit
    `max_tokens` that does not fit beside the prompt is refused too (as OpenAI
    does), never silently shortened; without one, generation may use
    `default_max_tokens` (None: the whole rest of the context), clamped to fit.
    """
    room = context_length - num_prompt_tokens
    if room < 1:
        raise invalid(
            f"This model's maximum context length is {context_length} tokens. However, your {prompt_param} "
            f"resulted in {num_prompt_tokens} tokens, which leaves no room for a completion. "
            f"Please reduce the length of the {prompt_param}.",
            prompt_param, "context_length_exceeded")
    if fields.max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif fields.max_tokens > room:
        raise invalid(
            f"This model's maximum context length is {context_length} tokens. However, you requested "
            f"{num_prompt_tokens + fields.max_tokens} tokens ({num_prompt_tokens} in the {prompt_param}, "
            f"{fields.max_tokens} in the completion). Please reduce the length of the {prompt_param} "
            f"or completion.",
            fields.max_tokens_param, "context_length_exceeded")
    else:
        max_tokens = fields.max_tokens
    if fields.min_tokens > max_tokens:
        raise bad_value("min_tokens", f"must be at most max_tokens ({max_tokens}), got {fields.min_tokens}.")
    return SamplingParams(
        temperature=fields.temperature,
        top_p=fields.top_p,
        top_k=fields.top_k,
        seed=fields.seed,
        max_tokens=max_tokens,
        stop=fields.stop,
        stop_token_ids=fields.stop_token_ids,
        ignore_eos=fields.ignore_eos,
        logprobs=fields.logprobs,
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
        repetition_penalty=fields.repetition_penalty,
        min_tokens=fields.min_tokens,
        logit_bias=fields.logit_bias,
        grammar=fields.grammar,
        skip_special_tokens=fields.skip_special_tokens,
        include_stop_str_in_output=fields.include_stop_str_in_output,
    )
