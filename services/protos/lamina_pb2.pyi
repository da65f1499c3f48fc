from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    grammar: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Logprobs(_message.Message):
    __slots__ = ("logprob", "top")
    class Top(_message.Message):
        __slots__ = ("token_id", "logprob")
        TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
        LOGPROB_FIELD_NUMBER: _ClassVar[int]
        token_id: int
        logprob: float
        def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[Logprobs.Top]
    def __init__(self, logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[Logprobs.Top, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "has_seed", "prompt_logprobs", "n")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    has_seed: bool
    prompt_logprobs: bool
    n: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., has_seed: _Optional[bool] = ..., prompt_logprobs: _Optional[bool] = ..., n: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "logprobs", "prompt_logprobs", "index", "cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    index: int
    cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., index: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "choice")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choice: int
    def __init__(self, request_id: _Optional[str] = ..., choice: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_steps", "mean_batch_size", "max_queue")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_steps: int
    mean_batch_size: float
    max_queue: int
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_steps: _Optional[int] = ..., mean_batch_size: _Optional[float] = ..., max_queue: _Optional[int] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, workers: _Optional[_Iterable[int]] = ...) -> None: ...

class PeerPrefix(_message.Message):
    __slots__ = ("node", "address", "tokens")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    tokens: int
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "params", "placement", "prompt_logprobs", "peer", "choice_seeds")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    CHOICE_SEEDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    placement: Placement
    prompt_logprobs: bool
    peer: PeerPrefix
    choice_seeds: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., prompt_logprobs: _Optional[bool] = ..., peer: _Optional[_Union[PeerPrefix, _Mapping]] = ..., choice_seeds: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("token_id", "cached_tokens", "fetched_tokens", "logprobs", "prompt_logprobs", "choice_token_ids", "choice_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FETCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CHOICE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    cached_tokens: int
    fetched_tokens: int
    logprobs: Logprobs
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    choice_token_ids: _containers.RepeatedScalarFieldContainer[int]
    choice_logprobs: _containers.RepeatedCompositeFieldContainer[Logprobs]
    def __init__(self, token_id: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., fetched_tokens: _Optional[int] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ..., choice_token_ids: _Optional[_Iterable[int]] = ..., choice_logprobs: _Optional[_Iterable[_Union[Logprobs, _Mapping]]] = ...) -> None: ...

class TierDistanceRequest(_message.Message):
    __slots__ = ("prompts",)
    class Prompt(_message.Message):
        __slots__ = ("token_ids",)
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    prompts: _containers.RepeatedCompositeFieldContainer[TierDistanceRequest.Prompt]
    def __init__(self, prompts: _Optional[_Iterable[_Union[TierDistanceRequest.Prompt, _Mapping]]] = ...) -> None: ...

class TierDistanceResult(_message.Message):
    __slots__ = ("distances",)
    DISTANCES_FIELD_NUMBER: _ClassVar[int]
    distances: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, distances: _Optional[_Iterable[int]] = ...) -> None: ...

class StepSequence(_message.Message):
    __slots__ = ("seq_id", "token_id", "position", "params", "output_index", "placement", "prompt_token_ids", "output_token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_id: int
    position: int
    params: SamplingParams
    output_index: int
    placement: Placement
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[str] = ..., token_id: _Optional[int] = ..., position: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., output_index: _Optional[int] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class StopRule(_message.Message):
    __slots__ = ("eos_token_ids", "max_model_len")
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_model_len: int
    def __init__(self, eos_token_ids: _Optional[_Iterable[int]] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class DecodeUpdate(_message.Message):
    __slots__ = ("joins", "leaves", "stop")
    JOINS_FIELD_NUMBER: _ClassVar[int]
    LEAVES_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    joins: _containers.RepeatedCompositeFieldContainer[StepSequence]
    leaves: _containers.RepeatedScalarFieldContainer[str]
    stop: StopRule
    def __init__(self, joins: _Optional[_Iterable[_Union[StepSequence, _Mapping]]] = ..., leaves: _Optional[_Iterable[str]] = ..., stop: _Optional[_Union[StopRule, _Mapping]] = ...) -> None: ...

class DecodeToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "finished", "logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    token_id: int
    finished: bool
    logprobs: Logprobs
    def __init__(self, seq_id: _Optional[str] = ..., token_id: _Optional[int] = ..., finished: _Optional[bool] = ..., logprobs: _Optional[_Union[Logprobs, _Mapping]] = ...) -> None: ...

class DecodeFailure(_message.Message):
    __slots__ = ("seq_id", "code", "message")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq_id: str
    code: str
    message: str
    def __init__(self, seq_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class DecodeResult(_message.Message):
    __slots__ = ("micro_batch", "step", "tokens", "left", "failed")
    MICRO_BATCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    micro_batch: int
    step: int
    tokens: _containers.RepeatedCompositeFieldContainer[DecodeToken]
    left: _containers.RepeatedScalarFieldContainer[str]
    failed: _containers.RepeatedCompositeFieldContainer[DecodeFailure]
    def __init__(self, micro_batch: _Optional[int] = ..., step: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[DecodeToken, _Mapping]]] = ..., left: _Optional[_Iterable[str]] = ..., failed: _Optional[_Iterable[_Union[DecodeFailure, _Mapping]]] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("seq_ids",)
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("seq_ids", "idle_s")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    idle_s: float
    def __init__(self, seq_ids: _Optional[_Iterable[str]] = ..., idle_s: _Optional[float] = ...) -> None: ...

class RetainReply(_message.Message):
    __slots__ = ("freed",)
    FREED_FIELD_NUMBER: _ClassVar[int]
    freed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, freed: _Optional[_Iterable[str]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("source", "seq_ids", "num_tokens")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    source: str
    seq_ids: _containers.RepeatedScalarFieldContainer[str]
    num_tokens: int
    def __init__(self, source: _Optional[str] = ..., seq_ids: _Optional[_Iterable[str]] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class AttentionStats(_message.Message):
    __slots__ = ("num_sequences", "num_tokens", "used_bytes", "capacity_bytes", "occupancy", "fragmentation", "capacity_tokens", "num_sequence_tokens")
    NUM_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SEQUENCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_sequences: int
    num_tokens: int
    used_bytes: int
    capacity_bytes: int
    occupancy: float
    fragmentation: float
    capacity_tokens: int
    num_sequence_tokens: int
    def __init__(self, num_sequences: _Optional[int] = ..., num_tokens: _Optional[int] = ..., used_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., occupancy: _Optional[float] = ..., fragmentation: _Optional[float] = ..., capacity_tokens: _Optional[int] = ..., num_sequence_tokens: _Optional[int] = ...) -> None: ...
