"""Attention backends over the paged KV cache (`base` documents the interface)."""

from __future__ import annotations

from worker_service.attention import torch_backend as _torch_backend  # noqa: F401 (registers)
from worker_service.attention.base import (
    AttentionBackend,
    AttentionBackendError,
    AttentionMetadata,
    AttentionSpec,
    get_backend_class,
    register_backend,
)

__all__ = [
    "AttentionBackend",
    "AttentionBackendError",
    "AttentionMetadata",
    "AttentionSpec",
    "get_backend_class",
    "register_backend",
]
