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

class EngineState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ENGINE_STATE_UNSPECIFIED: _ClassVar[EngineState]
    ENGINE_STATE_SERVING: _ClassVar[EngineState]
    ENGINE_STATE_DRAINING: _ClassVar[EngineState]
    ENGINE_STATE_DEAD: _ClassVar[EngineState]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
ENGINE_STATE_UNSPECIFIED: EngineState
ENGINE_STATE_SERVING: EngineState
ENGINE_STATE_DRAINING: EngineState
ENGINE_STATE_DEAD: EngineState

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs", "top_logprobs", "min_tokens", "structured")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    min_tokens: int
    structured: StructuredOutput
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., min_tokens: _Optional[int] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "block_hashes", "trace_context", "priority")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    cache_salt: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    trace_context: _containers.ScalarMap[str, str]
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., priority: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "usage", "top_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    usage: Usage
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("num_blocks_total", "num_blocks_used", "num_blocks_cached", "num_running", "num_waiting", "prefix_queries", "prefix_hits", "num_preemptions", "kv_cache_usage", "prompt_tokens_total", "generation_tokens_total", "kv_event_seq", "worker_id", "incarnation", "engine_state", "engine_error", "priority_loads")
    NUM_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_STATE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ERROR_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_LOADS_FIELD_NUMBER: _ClassVar[int]
    num_blocks_total: int
    num_blocks_used: int
    num_blocks_cached: int
    num_running: int
    num_waiting: int
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    kv_cache_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    kv_event_seq: int
    worker_id: str
    incarnation: int
    engine_state: EngineState
    engine_error: str
    priority_loads: _containers.RepeatedCompositeFieldContainer[PriorityLoad]
    def __init__(self, num_blocks_total: _Optional[int] = ..., num_blocks_used: _Optional[int] = ..., num_blocks_cached: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., prefix_queries: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., kv_event_seq: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., engine_state: _Optional[_Union[EngineState, str]] = ..., engine_error: _Optional[str] = ..., priority_loads: _Optional[_Iterable[_Union[PriorityLoad, _Mapping]]] = ...) -> None: ...

class PriorityLoad(_message.Message):
    __slots__ = ("priority", "running_blocks", "waiting")
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    priority: int
    running_blocks: int
    waiting: int
    def __init__(self, priority: _Optional[int] = ..., running_blocks: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_id", "block_size", "hash_fingerprint", "max_model_len", "vocab_size", "num_kv_blocks", "kv_cache_dtype", "dtype", "max_num_seqs", "tokenizer_fingerprint", "worker_id", "incarnation", "attention_backend", "dtype_reason", "num_host_kv_blocks")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    block_size: int
    hash_fingerprint: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    kv_cache_dtype: str
    dtype: str
    max_num_seqs: int
    tokenizer_fingerprint: str
    worker_id: str
    incarnation: int
    attention_backend: str
    dtype_reason: str
    num_host_kv_blocks: int
    def __init__(self, model_id: _Optional[str] = ..., block_size: _Optional[int] = ..., hash_fingerprint: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., kv_cache_dtype: _Optional[str] = ..., dtype: _Optional[str] = ..., max_num_seqs: _Optional[int] = ..., tokenizer_fingerprint: _Optional[str] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., attention_backend: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., num_host_kv_blocks: _Optional[int] = ...) -> None: ...

class GetKVEventsRequest(_message.Message):
    __slots__ = ("after_seq", "max_events", "snapshot_cursor", "max_snapshot_blocks")
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    MAX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    MAX_SNAPSHOT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    after_seq: int
    max_events: int
    snapshot_cursor: bytes
    max_snapshot_blocks: int
    def __init__(self, after_seq: _Optional[int] = ..., max_events: _Optional[int] = ..., snapshot_cursor: _Optional[bytes] = ..., max_snapshot_blocks: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("seq", "kind", "block_hashes", "parent_hash", "medium")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        KIND_STORED: _ClassVar[KVEvent.Kind]
        KIND_REMOVED: _ClassVar[KVEvent.Kind]
        KIND_CLEARED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    KIND_STORED: KVEvent.Kind
    KIND_REMOVED: KVEvent.Kind
    KIND_CLEARED: KVEvent.Kind
    SEQ_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    seq: int
    kind: KVEvent.Kind
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    medium: str
    def __init__(self, seq: _Optional[int] = ..., kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., medium: _Optional[str] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("is_snapshot", "snapshot_seq", "snapshot_hashes", "events", "latest_seq", "worker_id", "incarnation", "next_snapshot_cursor", "snapshot_medium")
    IS_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_HASHES_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    LATEST_SEQ_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NEXT_SNAPSHOT_CURSOR_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_MEDIUM_FIELD_NUMBER: _ClassVar[int]
    is_snapshot: bool
    snapshot_seq: int
    snapshot_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    latest_seq: int
    worker_id: str
    incarnation: int
    next_snapshot_cursor: bytes
    snapshot_medium: str
    def __init__(self, is_snapshot: _Optional[bool] = ..., snapshot_seq: _Optional[int] = ..., snapshot_hashes: _Optional[_Iterable[bytes]] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ..., latest_seq: _Optional[int] = ..., worker_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., next_snapshot_cursor: _Optional[bytes] = ..., snapshot_medium: _Optional[str] = ...) -> None: ...
