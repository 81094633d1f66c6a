"""Request priorities, as vLLM has them: lower values are served first, default 0. They travel
as int32 in the protos (AddRequest.priority, GenerateRequest.priority)."""

from __future__ import annotations

from llmserve.errors import FieldError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def check_priority(priority: object, field_name: str = "priority") -> int:
    """`priority` as a client sent it: an integer that fits the protos' int32."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise FieldError(field_name, f"must be an integer, got {priority!r}")
    if not INT32_MIN <= priority <= INT32_MAX:
        raise FieldError(field_name, f"must be in [{INT32_MIN}, {INT32_MAX}], got {priority}")
    return priority
