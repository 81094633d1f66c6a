"""llmserve: shared runtime (config, telemetry, client SDK, CLI) and the scheduler/worker contract."""

from llmserve.errors import ApiError, FieldError
from llmserve.sampling_params import SamplingParams

__all__ = ["ApiError", "FieldError", "SamplingParams"]
