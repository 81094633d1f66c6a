"""llmserve: shared runtime (config, telemetry, client SDK, CLI) and the scheduler/worker contract."""

from llmserve.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["SamplingParams", "SamplingParamsError"]
