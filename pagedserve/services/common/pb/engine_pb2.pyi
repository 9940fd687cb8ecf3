from pagedserve.services.common.pb import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]

class ErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_KIND_UNSPECIFIED: _ClassVar[ErrorKind]
    ERROR_KIND_INVALID_ARGUMENT: _ClassVar[ErrorKind]
    ERROR_KIND_RESOURCE_EXHAUSTED: _ClassVar[ErrorKind]
    ERROR_KIND_UNAVAILABLE: _ClassVar[ErrorKind]

class TokenEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_EVENT_KIND_TOKENS: _ClassVar[TokenEventKind]
    TOKEN_EVENT_KIND_TAKEN: _ClassVar[TokenEventKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
ERROR_KIND_UNSPECIFIED: ErrorKind
ERROR_KIND_INVALID_ARGUMENT: ErrorKind
ERROR_KIND_RESOURCE_EXHAUSTED: ErrorKind
ERROR_KIND_UNAVAILABLE: ErrorKind
TOKEN_EVENT_KIND_TOKENS: TokenEventKind
TOKEN_EVENT_KIND_TAKEN: TokenEventKind

class EngineSamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "stop_token_ids", "ignore_eos", "eos_token_ids", "n", "logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids", "bad_words_token_ids", "structured_output")
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
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_WORDS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    n: int
    logprobs: int
    prompt_logprobs: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    allowed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    bad_words_token_ids: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    structured_output: _generate_pb2.StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., n: _Optional[int] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., allowed_token_ids: _Optional[_Iterable[int]] = ..., bad_words_token_ids: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., structured_output: _Optional[_Union[_generate_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "first_position", "entries")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_POSITION_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    seq_id: SequenceId
    first_position: int
    entries: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    def __init__(self, seq_id: _Optional[_Union[SequenceId, _Mapping]] = ..., first_position: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ...) -> None: ...

class QueuedRequest(_message.Message):
    __slots__ = ("request_id", "gateway_id", "prompt_token_ids", "sampling_params", "arrival_time", "trace_context", "priority", "cache_salt", "signature")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    gateway_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: EngineSamplingParams
    arrival_time: float
    trace_context: _containers.ScalarMap[str, str]
    priority: int
    cache_salt: str
    signature: bytes
    def __init__(self, request_id: _Optional[str] = ..., gateway_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[EngineSamplingParams, _Mapping]] = ..., arrival_time: _Optional[float] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SchedulerRegistration(_message.Message):
    __slots__ = ("scheduler_id", "address", "instance_id", "num_blocks", "signature", "num_waiting", "num_running", "lease_ttl_s")
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    scheduler_id: str
    address: str
    instance_id: str
    num_blocks: int
    signature: bytes
    num_waiting: int
    num_running: int
    lease_ttl_s: float
    def __init__(self, scheduler_id: _Optional[str] = ..., address: _Optional[str] = ..., instance_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., signature: _Optional[bytes] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class WorkerRegistration(_message.Message):
    __slots__ = ("worker_id", "address", "num_blocks", "block_size", "model", "num_cpu_blocks", "instance_id", "signature", "heartbeat", "num_speculative_tokens", "device")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    num_blocks: int
    block_size: int
    model: str
    num_cpu_blocks: int
    instance_id: str
    signature: bytes
    heartbeat: int
    num_speculative_tokens: int
    device: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., num_cpu_blocks: _Optional[int] = ..., instance_id: _Optional[str] = ..., signature: _Optional[bytes] = ..., heartbeat: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class GrammarBuilt(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SequenceId(_message.Message):
    __slots__ = ("request_id", "sample_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ...) -> None: ...

class NewRequest(_message.Message):
    __slots__ = ("seq_id", "token_ids", "num_prompt_tokens", "block_ids", "num_computed_tokens", "num_scheduled_tokens", "sampling_params", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    seq_id: SequenceId
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    sampling_params: EngineSamplingParams
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, seq_id: _Optional[_Union[SequenceId, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling_params: _Optional[_Union[EngineSamplingParams, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CachedRequest(_message.Message):
    __slots__ = ("seq_id", "new_block_ids", "num_computed_tokens", "num_scheduled_tokens", "num_lookahead_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKAHEAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: SequenceId
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_lookahead_tokens: int
    def __init__(self, seq_id: _Optional[_Union[SequenceId, _Mapping]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., num_scheduled_tokens: _Optional[int] = ..., num_lookahead_tokens: _Optional[int] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("source", "target")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    source: int
    target: int
    def __init__(self, source: _Optional[int] = ..., target: _Optional[int] = ...) -> None: ...

class BatchPlan(_message.Message):
    __slots__ = ("step_id", "new_requests", "cached_requests", "finished_seq_ids", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "session_id", "lease_epoch")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_requests: _containers.RepeatedCompositeFieldContainer[NewRequest]
    cached_requests: _containers.RepeatedCompositeFieldContainer[CachedRequest]
    finished_seq_ids: _containers.RepeatedCompositeFieldContainer[SequenceId]
    blocks_to_swap_out: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    blocks_to_swap_in: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    blocks_to_copy: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    session_id: str
    lease_epoch: int
    def __init__(self, step_id: _Optional[int] = ..., new_requests: _Optional[_Iterable[_Union[NewRequest, _Mapping]]] = ..., cached_requests: _Optional[_Iterable[_Union[CachedRequest, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[_Union[SequenceId, _Mapping]]] = ..., blocks_to_swap_out: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., blocks_to_swap_in: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., blocks_to_copy: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ..., session_id: _Optional[str] = ..., lease_epoch: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id", "logprob", "sample_index", "logprobs", "grammar_error", "accepted", "num_draft_tokens")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_id: SequenceId
    token_id: int
    logprob: float
    sample_index: int
    logprobs: TokenLogprobs
    grammar_error: str
    accepted: _containers.RepeatedCompositeFieldContainer[AcceptedDraft]
    num_draft_tokens: int
    def __init__(self, seq_id: _Optional[_Union[SequenceId, _Mapping]] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., sample_index: _Optional[int] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ..., grammar_error: _Optional[str] = ..., accepted: _Optional[_Iterable[_Union[AcceptedDraft, _Mapping]]] = ..., num_draft_tokens: _Optional[int] = ...) -> None: ...

class AcceptedDraft(_message.Message):
    __slots__ = ("token_id", "logprob", "logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    logprobs: TokenLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., logprobs: _Optional[_Union[TokenLogprobs, _Mapping]] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled", "prompt_logprobs")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled: _containers.RepeatedCompositeFieldContainer[SampledToken]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    def __init__(self, step_id: _Optional[int] = ..., sampled: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ...) -> None: ...

class HeldRequestsRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HeldRequestsResponse(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamOutputsRequest(_message.Message):
    __slots__ = ("gateway_id", "scheduler_id")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ID_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    scheduler_id: str
    def __init__(self, gateway_id: _Optional[str] = ..., scheduler_id: _Optional[str] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("message", "kind")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    message: str
    kind: ErrorKind
    def __init__(self, message: _Optional[str] = ..., kind: _Optional[_Union[ErrorKind, str]] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("request_id", "kind", "first_output_index", "token_ids", "finish_reason", "error", "sample_index", "logprobs", "prompt_logprobs", "stop_token_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FIRST_OUTPUT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: TokenEventKind
    first_output_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    error: RequestError
    sample_index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: PromptLogprobs
    stop_token_id: int
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[_Union[TokenEventKind, str]] = ..., first_output_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., sample_index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class TokenEventBatch(_message.Message):
    __slots__ = ("events", "resume_queries")
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    RESUME_QUERIES_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    resume_queries: _containers.RepeatedCompositeFieldContainer[ResumeQuery]
    def __init__(self, events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ..., resume_queries: _Optional[_Iterable[_Union[ResumeQuery, _Mapping]]] = ...) -> None: ...

class ResumeQuery(_message.Message):
    __slots__ = ("request_id", "taken_at_us")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TAKEN_AT_US_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    taken_at_us: int
    def __init__(self, request_id: _Optional[str] = ..., taken_at_us: _Optional[int] = ...) -> None: ...

class ResumedSample(_message.Message):
    __slots__ = ("sample_index", "token_ids", "finished")
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: bool
    def __init__(self, sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[bool] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ("request_id", "gateway_id", "samples", "num_migrations")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    gateway_id: str
    samples: _containers.RepeatedCompositeFieldContainer[ResumedSample]
    num_migrations: int
    def __init__(self, request_id: _Optional[str] = ..., gateway_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[ResumedSample, _Mapping]]] = ..., num_migrations: _Optional[int] = ...) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "sample_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "num_blocks", "num_free_blocks", "num_running", "num_swapped", "num_cached_blocks", "token_budget")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_swapped: int
    num_cached_blocks: int
    token_budget: int
    def __init__(self, worker_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., token_budget: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("num_waiting", "num_running", "num_preemptions", "num_steps", "workers", "num_swapped", "num_swap_preemptions", "prefix_cache_queries", "prefix_cache_hits", "spec_decode")
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAP_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_steps: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    num_swapped: int
    num_swap_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode: SpecDecodeCounters
    def __init__(self, num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., num_swapped: _Optional[int] = ..., num_swap_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., spec_decode: _Optional[_Union[SpecDecodeCounters, _Mapping]] = ...) -> None: ...

class SpecDecodeCounters(_message.Message):
    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_drafts: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ...) -> None: ...
