"""The scheduler's engine: sequences, paged block manager, iteration scheduler and step loop."""

from llmserve.sampling_params import SamplingParams
from scheduler_service.engine.block_allocator import BlockAllocator, Device, LRUEvictor
from scheduler_service.engine.block_manager import AllocStatus, BlockSpaceManager
from scheduler_service.engine.config import (
    CacheConfig,
    ConfigError,
    PreemptionMode,
    SchedulerConfig,
)
from scheduler_service.engine.llm_engine import LLMEngine
from scheduler_service.engine.offline import EngineStalledError
from scheduler_service.engine.outputs import WorkerOutputError
from scheduler_service.engine.request_output import CompletionOutput, RequestOutput
from scheduler_service.engine.scheduler import Scheduler
from scheduler_service.engine.scheduler_outputs import (
    PreemptedGroup,
    ScheduledGroup,
    SchedulerOutputs,
    SchedulerStats,
)
from scheduler_service.engine.sequence import (
    FinishReason,
    RequestMetrics,
    SampleLogprobs,
    Sequence,
    SequenceGroup,
    SequenceStatus,
)

__all__ = [
    "AllocStatus",
    "BlockAllocator",
    "BlockSpaceManager",
    "CacheConfig",
    "CompletionOutput",
    "ConfigError",
    "Device",
    "EngineStalledError",
    "FinishReason",
    "LLMEngine",
    "LRUEvictor",
    "PreemptedGroup",
    "PreemptionMode",
    "RequestMetrics",
    "RequestOutput",
    "SampleLogprobs",
    "SamplingParams",
    "ScheduledGroup",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutputs",
    "SchedulerStats",
    "Sequence",
    "SequenceGroup",
    "SequenceStatus",
    "WorkerOutputError",
]
