from llmserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_JOINING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_LOST: _ClassVar[WorkerState]
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_JOINING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_LOST: WorkerState

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("replica_id", "lease_ms")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    lease_ms: int
    def __init__(self, replica_id: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class DrainWorkerResponse(_message.Message):
    __slots__ = ("replica_id", "num_requests")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    num_requests: int
    def __init__(self, replica_id: _Optional[int] = ..., num_requests: _Optional[int] = ...) -> None: ...

class GatewayMessage(_message.Message):
    __slots__ = ("add", "abort", "batch")
    ADD_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    add: AddRequest
    abort: AbortRequest
    batch: GatewayMessageBatch
    def __init__(self, add: _Optional[_Union[AddRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ..., batch: _Optional[_Union[GatewayMessageBatch, _Mapping]] = ...) -> None: ...

class GatewayMessageBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[GatewayMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[GatewayMessage, _Mapping]]] = ...) -> None: ...

class AddRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "priority", "traceparent", "continuation", "stop", "decode_special_tokens", "timeout_ms", "grammar", "reasoning", "resubmitted")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    DECODE_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    REASONING_FIELD_NUMBER: _ClassVar[int]
    RESUBMITTED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    eos_token_id: int
    priority: int
    traceparent: str
    continuation: Continuation
    stop: _containers.RepeatedScalarFieldContainer[str]
    decode_special_tokens: bool
    timeout_ms: int
    grammar: _common_pb2.Grammar
    reasoning: _common_pb2.Reasoning
    resubmitted: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., eos_token_id: _Optional[int] = ..., priority: _Optional[int] = ..., traceparent: _Optional[str] = ..., continuation: _Optional[_Union[Continuation, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ..., decode_special_tokens: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ..., reasoning: _Optional[_Union[_common_pb2.Reasoning, _Mapping]] = ..., resubmitted: _Optional[bool] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedCompositeFieldContainer[ContinuedChoice]
    def __init__(self, choices: _Optional[_Iterable[_Union[ContinuedChoice, _Mapping]]] = ...) -> None: ...

class ContinuedChoice(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "cumulative_logprob", "finish_reason", "stop_token_id")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.OutputLogprob]
    cumulative_logprob: float
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.OutputLogprob, _Mapping]]] = ..., cumulative_logprob: _Optional[float] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SchedulerMessage(_message.Message):
    __slots__ = ("output", "error", "batch")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    output: RequestOutput
    error: RequestError
    batch: SchedulerMessageBatch
    def __init__(self, output: _Optional[_Union[RequestOutput, _Mapping]] = ..., error: _Optional[_Union[RequestError, _Mapping]] = ..., batch: _Optional[_Union[SchedulerMessageBatch, _Mapping]] = ...) -> None: ...

class SchedulerMessageBatch(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[SchedulerMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[SchedulerMessage, _Mapping]]] = ...) -> None: ...

class ChoiceDelta(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "stop_token_id", "cumulative_logprob")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.OutputLogprob]
    finish_reason: _common_pb2.FinishReason
    stop_token_id: int
    cumulative_logprob: float
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.OutputLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("queue_ns", "first_token_ns", "e2e_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    E2E_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    first_token_ns: int
    e2e_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., first_token_ns: _Optional[int] = ..., e2e_ns: _Optional[int] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "choices", "prompt_logprobs", "finished", "usage", "metrics")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    choices: _containers.RepeatedCompositeFieldContainer[ChoiceDelta]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptLogprob]
    finished: bool
    usage: _common_pb2.Usage
    metrics: RequestMetrics
    def __init__(self, request_id: _Optional[str] = ..., choices: _Optional[_Iterable[_Union[ChoiceDelta, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ...) -> None: ...

class RequestError(_message.Message):
    __slots__ = ("request_id", "code", "message", "field")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    field: str
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., field: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("check_invariants",)
    CHECK_INVARIANTS_FIELD_NUMBER: _ClassVar[int]
    check_invariants: bool
    def __init__(self, check_invariants: _Optional[bool] = ...) -> None: ...

class ReplicaStats(_message.Message):
    __slots__ = ("replica_id", "address", "num_waiting", "num_running", "num_swapped", "gpu_blocks_free", "gpu_blocks_total", "cpu_blocks_free", "cpu_blocks_total", "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "num_steps", "healthy", "state", "num_migrated_out", "max_model_len", "invariant_violation", "num_transfers", "kv_groups", "state_slots_free", "state_slots_total")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_SWAPPED_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    CPU_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATED_OUT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    INVARIANT_VIOLATION_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    replica_id: int
    address: str
    num_waiting: int
    num_running: int
    num_swapped: int
    gpu_blocks_free: int
    gpu_blocks_total: int
    cpu_blocks_free: int
    cpu_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    healthy: bool
    state: WorkerState
    num_migrated_out: int
    max_model_len: int
    invariant_violation: str
    num_transfers: int
    kv_groups: _containers.RepeatedCompositeFieldContainer[KvGroupUsage]
    state_slots_free: int
    state_slots_total: int
    def __init__(self, replica_id: _Optional[int] = ..., address: _Optional[str] = ..., num_waiting: _Optional[int] = ..., num_running: _Optional[int] = ..., num_swapped: _Optional[int] = ..., gpu_blocks_free: _Optional[int] = ..., gpu_blocks_total: _Optional[int] = ..., cpu_blocks_free: _Optional[int] = ..., cpu_blocks_total: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_steps: _Optional[int] = ..., healthy: _Optional[bool] = ..., state: _Optional[_Union[WorkerState, str]] = ..., num_migrated_out: _Optional[int] = ..., max_model_len: _Optional[int] = ..., invariant_violation: _Optional[str] = ..., num_transfers: _Optional[int] = ..., kv_groups: _Optional[_Iterable[_Union[KvGroupUsage, _Mapping]]] = ..., state_slots_free: _Optional[int] = ..., state_slots_total: _Optional[int] = ...) -> None: ...

class KvGroupUsage(_message.Message):
    __slots__ = ("sliding_window", "blocks_used")
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    sliding_window: int
    blocks_used: int
    def __init__(self, sliding_window: _Optional[int] = ..., blocks_used: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("replicas", "num_unfinished_requests", "num_gateways", "max_model_len", "totals", "shard")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNFINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_GATEWAYS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStats]
    num_unfinished_requests: int
    num_gateways: int
    max_model_len: int
    totals: FleetTotals
    shard: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStats, _Mapping]]] = ..., num_unfinished_requests: _Optional[int] = ..., num_gateways: _Optional[int] = ..., max_model_len: _Optional[int] = ..., totals: _Optional[_Union[FleetTotals, _Mapping]] = ..., shard: _Optional[str] = ...) -> None: ...

class FleetTotals(_message.Message):
    __slots__ = ("num_steps", "num_migrated_out", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits")
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_MIGRATED_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    num_steps: int
    num_migrated_out: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    def __init__(self, num_steps: _Optional[int] = ..., num_migrated_out: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ...) -> None: ...
