"""The `priority` request field: an int32, refused with a FieldError that names it."""

from __future__ import annotations

import pytest

from gateway.generation_types import GenerationInput, Prompt
from llmserve.errors import FieldError, http_error
from llmserve.sampling_params import SamplingParams


@pytest.mark.parametrize("priority", [-(2**31), -1, 0, 7, 2**31 - 1])
def test_int32_priorities_are_accepted(priority: int) -> None:
    assert (
        GenerationInput("r", Prompt([1]), SamplingParams(), priority=priority).priority == priority
    )


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, 1.0, "1", True, None])
def test_other_priorities_are_a_400_naming_the_field(priority: object) -> None:
    with pytest.raises(FieldError) as info:
        GenerationInput("r", Prompt([1]), SamplingParams(), priority=priority)  # type: ignore[arg-type]
    error = http_error(info.value)
    assert (error.status, error.param) == (400, "priority")
    assert error.message.startswith("priority: ")
