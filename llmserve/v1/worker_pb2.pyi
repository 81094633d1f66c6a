from llmserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_MIXED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]

class TokenMaskKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOKEN_MASK_KIND_UNSPECIFIED: _ClassVar[TokenMaskKind]
    TOKEN_MASK_KIND_ALLOW: _ClassVar[TokenMaskKind]
    TOKEN_MASK_KIND_DENY: _ClassVar[TokenMaskKind]
    TOKEN_MASK_KIND_BITMAP: _ClassVar[TokenMaskKind]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_MIXED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
TOKEN_MASK_KIND_UNSPECIFIED: TokenMaskKind
TOKEN_MASK_KIND_ALLOW: TokenMaskKind
TOKEN_MASK_KIND_DENY: TokenMaskKind
TOKEN_MASK_KIND_BITMAP: TokenMaskKind

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "max_model_len", "eos_token_id", "vocab_size", "num_gpu_blocks_available", "num_cpu_blocks_available", "num_gpu_blocks", "num_cpu_blocks", "device", "attention_backend", "linear_impl", "weight_format", "weight_bytes", "execute_stream_open", "role", "kv_groups", "kv_group_blocks_used", "state_layers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    LINEAR_IMPL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_STREAM_OPEN_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    max_model_len: int
    eos_token_id: int
    vocab_size: int
    num_gpu_blocks_available: int
    num_cpu_blocks_available: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    device: str
    attention_backend: str
    linear_impl: str
    weight_format: str
    weight_bytes: int
    execute_stream_open: bool
    role: WorkerRole
    kv_groups: _containers.RepeatedCompositeFieldContainer[KvGroup]
    kv_group_blocks_used: _containers.RepeatedScalarFieldContainer[int]
    state_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., vocab_size: _Optional[int] = ..., num_gpu_blocks_available: _Optional[int] = ..., num_cpu_blocks_available: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., device: _Optional[str] = ..., attention_backend: _Optional[str] = ..., linear_impl: _Optional[str] = ..., weight_format: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., execute_stream_open: _Optional[bool] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., kv_groups: _Optional[_Iterable[_Union[KvGroup, _Mapping]]] = ..., kv_group_blocks_used: _Optional[_Iterable[int]] = ..., state_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class KvGroup(_message.Message):
    __slots__ = ("sliding_window", "layers")
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    sliding_window: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sliding_window: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class InitializeCacheRequest(_message.Message):
    __slots__ = ("num_gpu_blocks", "num_cpu_blocks", "max_num_seqs", "max_num_batched_tokens")
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_gpu_blocks: int
    num_cpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    def __init__(self, num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ...) -> None: ...

class InitializeCacheResponse(_message.Message):
    __slots__ = ("num_gpu_blocks", "num_cpu_blocks", "init_ns", "num_state_slots")
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INIT_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    num_gpu_blocks: int
    num_cpu_blocks: int
    init_ns: int
    num_state_slots: int
    def __init__(self, num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., init_ns: _Optional[int] = ..., num_state_slots: _Optional[int] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "request_id", "seq_index", "token_ids", "num_prompt_tokens", "num_computed_tokens", "block_ids", "num_scheduled_tokens", "sampling_params", "group_tables", "state_slot", "state_from_slot")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    GROUP_TABLES_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    STATE_FROM_SLOT_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    request_id: str
    seq_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: int
    sampling_params: _common_pb2.SamplingParams
    group_tables: _containers.RepeatedCompositeFieldContainer[BlockTable]
    state_slot: int
    state_from_slot: int
    def __init__(self, seq_id: _Optional[int] = ..., request_id: _Optional[str] = ..., seq_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., group_tables: _Optional[_Iterable[_Union[BlockTable, _Mapping]]] = ..., state_slot: _Optional[int] = ..., state_from_slot: _Optional[int] = ...) -> None: ...

class BlockTable(_message.Message):
    __slots__ = ("block_ids",)
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CachedSequences(_message.Message):
    __slots__ = ("seq_ids", "num_new_tokens", "new_token_ids", "block_offsets", "num_block_ids", "block_ids", "num_scheduled_tokens", "num_draft_tokens", "draft_token_ids", "after_drafts", "group_block_offsets", "num_group_block_ids", "group_block_ids")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    AFTER_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    GROUP_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_new_tokens: _containers.RepeatedScalarFieldContainer[int]
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_offsets: _containers.RepeatedScalarFieldContainer[int]
    num_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    after_drafts: _containers.RepeatedScalarFieldContainer[bool]
    group_block_offsets: _containers.RepeatedScalarFieldContainer[int]
    num_group_block_ids: _containers.RepeatedScalarFieldContainer[int]
    group_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_new_tokens: _Optional[_Iterable[int]] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., block_offsets: _Optional[_Iterable[int]] = ..., num_block_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., after_drafts: _Optional[_Iterable[bool]] = ..., group_block_offsets: _Optional[_Iterable[int]] = ..., num_group_block_ids: _Optional[_Iterable[int]] = ..., group_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Fork(_message.Message):
    __slots__ = ("parent_seq_id", "child_seq_id", "child_seq_index", "child_state_slot")
    PARENT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SEQ_INDEX_FIELD_NUMBER: _ClassVar[int]
    CHILD_STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    parent_seq_id: int
    child_seq_id: int
    child_seq_index: int
    child_state_slot: int
    def __init__(self, parent_seq_id: _Optional[int] = ..., child_seq_id: _Optional[int] = ..., child_seq_index: _Optional[int] = ..., child_state_slot: _Optional[int] = ...) -> None: ...

class BlockMapping(_message.Message):
    __slots__ = ("src", "dst")
    SRC_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    src: _containers.RepeatedScalarFieldContainer[int]
    dst: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, src: _Optional[_Iterable[int]] = ..., dst: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteRequest(_message.Message):
    __slots__ = ("step_id", "new_seqs", "cached_seqs", "forks", "freed_seq_ids", "blocks_to_swap_out", "blocks_to_swap_in", "blocks_to_copy", "traceparent", "token_masks", "deferred_mask_seq_ids", "step_masks", "released_transfer_ids", "exports", "imports", "state_saves", "states_to_swap_out", "states_to_swap_in", "end_passes")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQS_FIELD_NUMBER: _ClassVar[int]
    CACHED_SEQS_FIELD_NUMBER: _ClassVar[int]
    FORKS_FIELD_NUMBER: _ClassVar[int]
    FREED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_TO_COPY_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_MASK_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_MASKS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    IMPORTS_FIELD_NUMBER: _ClassVar[int]
    STATE_SAVES_FIELD_NUMBER: _ClassVar[int]
    STATES_TO_SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    STATES_TO_SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    END_PASSES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    new_seqs: _containers.RepeatedCompositeFieldContainer[NewSequence]
    cached_seqs: CachedSequences
    forks: _containers.RepeatedCompositeFieldContainer[Fork]
    freed_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    blocks_to_swap_out: BlockMapping
    blocks_to_swap_in: BlockMapping
    blocks_to_copy: BlockMapping
    traceparent: str
    token_masks: _containers.RepeatedCompositeFieldContainer[TokenMask]
    deferred_mask_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    step_masks: StepMasks
    released_transfer_ids: _containers.RepeatedScalarFieldContainer[int]
    exports: _containers.RepeatedCompositeFieldContainer[BlockExport]
    imports: _containers.RepeatedCompositeFieldContainer[BlockImport]
    state_saves: BlockMapping
    states_to_swap_out: BlockMapping
    states_to_swap_in: BlockMapping
    end_passes: EndPasses
    def __init__(self, step_id: _Optional[int] = ..., new_seqs: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., cached_seqs: _Optional[_Union[CachedSequences, _Mapping]] = ..., forks: _Optional[_Iterable[_Union[Fork, _Mapping]]] = ..., freed_seq_ids: _Optional[_Iterable[int]] = ..., blocks_to_swap_out: _Optional[_Union[BlockMapping, _Mapping]] = ..., blocks_to_swap_in: _Optional[_Union[BlockMapping, _Mapping]] = ..., blocks_to_copy: _Optional[_Union[BlockMapping, _Mapping]] = ..., traceparent: _Optional[str] = ..., token_masks: _Optional[_Iterable[_Union[TokenMask, _Mapping]]] = ..., deferred_mask_seq_ids: _Optional[_Iterable[int]] = ..., step_masks: _Optional[_Union[StepMasks, _Mapping]] = ..., released_transfer_ids: _Optional[_Iterable[int]] = ..., exports: _Optional[_Iterable[_Union[BlockExport, _Mapping]]] = ..., imports: _Optional[_Iterable[_Union[BlockImport, _Mapping]]] = ..., state_saves: _Optional[_Union[BlockMapping, _Mapping]] = ..., states_to_swap_out: _Optional[_Union[BlockMapping, _Mapping]] = ..., states_to_swap_in: _Optional[_Union[BlockMapping, _Mapping]] = ..., end_passes: _Optional[_Union[EndPasses, _Mapping]] = ...) -> None: ...

class EndPasses(_message.Message):
    __slots__ = ("through_step_id",)
    THROUGH_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    through_step_id: int
    def __init__(self, through_step_id: _Optional[int] = ...) -> None: ...

class BlockExport(_message.Message):
    __slots__ = ("transfer_id", "block_ids", "state_slot")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    state_slot: int
    def __init__(self, transfer_id: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., state_slot: _Optional[int] = ...) -> None: ...

class BlockImport(_message.Message):
    __slots__ = ("transfer_id", "peer", "block_ids", "state_slot")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    peer: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    state_slot: int
    def __init__(self, transfer_id: _Optional[int] = ..., peer: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., state_slot: _Optional[int] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("transfer_id",)
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    def __init__(self, transfer_id: _Optional[int] = ...) -> None: ...

class BlockChunk(_message.Message):
    __slots__ = ("num_blocks", "block_bytes", "dtype", "data", "state_bytes")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_bytes: int
    dtype: str
    data: bytes
    state_bytes: int
    def __init__(self, num_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., dtype: _Optional[str] = ..., data: _Optional[bytes] = ..., state_bytes: _Optional[int] = ...) -> None: ...

class StepMasks(_message.Message):
    __slots__ = ("step_id", "token_masks")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    token_masks: _containers.RepeatedCompositeFieldContainer[TokenMask]
    def __init__(self, step_id: _Optional[int] = ..., token_masks: _Optional[_Iterable[_Union[TokenMask, _Mapping]]] = ...) -> None: ...

class TokenMask(_message.Message):
    __slots__ = ("seq_id", "kind", "vocab_size", "token_ids", "bitmap", "row")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BITMAP_FIELD_NUMBER: _ClassVar[int]
    ROW_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    kind: TokenMaskKind
    vocab_size: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    bitmap: bytes
    row: int
    def __init__(self, seq_id: _Optional[int] = ..., kind: _Optional[_Union[TokenMaskKind, str]] = ..., vocab_size: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., bitmap: _Optional[bytes] = ..., row: _Optional[int] = ...) -> None: ...

class SequenceOutputs(_message.Message):
    __slots__ = ("seq_ids", "num_samples", "sample_token_ids", "sample_logprobs", "sample_ranks", "num_top_logprobs", "top_token_ids", "top_logprobs", "top_ranks")
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_RANKS_FIELD_NUMBER: _ClassVar[int]
    seq_ids: _containers.RepeatedScalarFieldContainer[int]
    num_samples: _containers.RepeatedScalarFieldContainer[int]
    sample_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sample_logprobs: _containers.RepeatedScalarFieldContainer[float]
    sample_ranks: _containers.RepeatedScalarFieldContainer[int]
    num_top_logprobs: _containers.RepeatedScalarFieldContainer[int]
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_ids: _Optional[_Iterable[int]] = ..., num_samples: _Optional[_Iterable[int]] = ..., sample_token_ids: _Optional[_Iterable[int]] = ..., sample_logprobs: _Optional[_Iterable[float]] = ..., sample_ranks: _Optional[_Iterable[int]] = ..., num_top_logprobs: _Optional[_Iterable[int]] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., top_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class SequencePromptLogprobs(_message.Message):
    __slots__ = ("seq_id", "prompt_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.PromptLogprob]
    def __init__(self, seq_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.PromptLogprob, _Mapping]]] = ...) -> None: ...

class ExecuteResult(_message.Message):
    __slots__ = ("step_id", "outputs", "forward_ns", "sample_ns", "prompt_logprobs", "mask_wait_ns", "imported_transfer_ids", "failed_imports")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MASK_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    IMPORTED_TRANSFER_IDS_FIELD_NUMBER: _ClassVar[int]
    FAILED_IMPORTS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    outputs: SequenceOutputs
    forward_ns: int
    sample_ns: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[SequencePromptLogprobs]
    mask_wait_ns: int
    imported_transfer_ids: _containers.RepeatedScalarFieldContainer[int]
    failed_imports: _containers.RepeatedCompositeFieldContainer[TransferFailure]
    def __init__(self, step_id: _Optional[int] = ..., outputs: _Optional[_Union[SequenceOutputs, _Mapping]] = ..., forward_ns: _Optional[int] = ..., sample_ns: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[SequencePromptLogprobs, _Mapping]]] = ..., mask_wait_ns: _Optional[int] = ..., imported_transfer_ids: _Optional[_Iterable[int]] = ..., failed_imports: _Optional[_Iterable[_Union[TransferFailure, _Mapping]]] = ...) -> None: ...

class TransferFailure(_message.Message):
    __slots__ = ("transfer_id", "reason")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    reason: str
    def __init__(self, transfer_id: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...
