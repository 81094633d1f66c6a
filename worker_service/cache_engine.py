"""The paged KV cache of one worker: device blocks, host swap blocks, and block moves.

Layout. For each layer there is a key cache and a value cache, each
`[num_blocks, block_size, num_kv_heads, head_dim]` in the model dtype: block-major so a
block id addresses one contiguous chunk of `block_size` tokens, token-major inside a block so
writing one token's K (all kv heads) is one contiguous store, head_dim innermost for the dot
products. A block holds `slots` layers (`llmserve.kv_layout`: the layers of the KV group the
scheduler gave it to, slot j for the group's j-th layer), and all slots live in one allocation
`[slots, 2, num_blocks, block_size, num_kv_heads, head_dim]` so a swap or copy moves a whole
block in one indexed copy, whatever group holds it; `layer_caches()[i]` are views of layer
i's slot. A model of one group has a slot per layer.

The recurrent layers of a hybrid model (`layout.state_layers`) keep a state slot per sequence
instead (`worker_service.linear_state.StatePools`); `layer_caches()[i]` of such a layer is
its (conv, recurrent) pools.

Host (swap) blocks use the same layout on the CPU, pinned when the device is CUDA so copies
can run asynchronously. The scheduler decides every block id; this class only moves data.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

from llmserve.kv_layout import KvLayout
from worker_service.linear_state import StatePools

_MADV_HUGEPAGE = 14  # linux/mman.h
_PAGE = 4096


def cache_block_size_bytes(
    slots: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
) -> int:
    """Bytes one block takes across its `slots` layers (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * slots * block_size * num_kv_heads * head_dim * element_size


class CacheEngine:
    """Owns the device KV cache and the host swap space of one worker."""

    def __init__(
        self,
        layout: KvLayout,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        states: StatePools | None = None,  # the recurrent layers' slots, if the model has any
    ) -> None:
        if (states is None) != (not layout.state_layers):
            raise ValueError("state pools are given exactly when the layout has state layers")
        self.layout = layout
        self.states = states
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.dtype = dtype
        self.device = device
        shape = (layout.slots, 2, 0, block_size, num_kv_heads, head_dim)
        # Zeroed, not empty: backends read (and mask) the tail of a sequence's last block, and
        # masked garbage must still be finite so that 0 * value stays 0.
        device_shape = shape[:2] + (num_device_blocks,) + shape[3:]
        if device.type == "cpu":
            self.device_cache = _zeros_on_huge_pages(device_shape, dtype)
        else:
            self.device_cache = torch.zeros(device_shape, dtype=dtype, device=device)
        # device_cache: [slots, 2, num_device_blocks, block_size, num_kv_heads, head_dim]
        # Empty, not zeroed: a host block is read only by swap_in, after a swap_out wrote the
        # whole block, so nothing reads what it held before. (Zeroing the default 4 GiB took
        # ~5 s of a CPU worker's InitializeCache, touching every page up front.)
        self.host_cache = torch.empty(
            shape[:2] + (num_host_blocks,) + shape[3:],
            dtype=dtype,
            pin_memory=device.type == "cuda",
        )  # [slots, 2, num_host_blocks, block_size, num_kv_heads, head_dim]

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads,
        head_dim]: the views of its slot; a recurrent layer's (conv, recurrent) state pools."""
        slot_of = self.layout.slot_of_layer()
        pools = {} if self.states is None else self.states.layer_pools()
        return [
            pools[i]
            if i in pools
            else (self.device_cache[slot_of[i][1], 0], self.device_cache[slot_of[i][1], 1])
            for i in range(self.layout.num_layers)
        ]

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, (device src, host dst) pairs, all layers."""
        if mapping:
            src, dst = self._split(mapping)
            moved = self.device_cache[:, :, src.to(self.device)].to("cpu")
            self.host_cache[:, :, dst] = moved

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks, (host src, device dst) pairs, all layers."""
        if mapping:
            src, dst = self._split(mapping)
            moved = self.host_cache[:, :, src].to(self.device, non_blocking=True)
            self.device_cache[:, :, dst.to(self.device)] = moved

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to device blocks (copy-on-write), (src, dst) pairs, all slots."""
        if mapping:
            src, dst = self._split(mapping)
            src, dst = src.to(self.device), dst.to(self.device)
            self.device_cache[:, :, dst] = self.device_cache[:, :, src]

    @property
    def block_bytes(self) -> int:
        """Bytes of one device block across its slots, K and V."""
        per_block = self.device_cache[:, :, 0]  # [slots, 2, block_size, heads, head_dim]
        return per_block.numel() * per_block.element_size()

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous host copy of device blocks in the cache's own layout: [slots, 2,
        n, block_size, num_kv_heads, head_dim] (one gather, no reordering)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.device_cache[:, :, index].to("cpu")

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Store blocks laid out as `read_blocks` returns them into device blocks."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.device_cache[:, :, index] = blocks.to(self.device)

    @staticmethod
    def _split(mapping: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = torch.tensor(mapping, dtype=torch.int64)  # [num_pairs, 2]
        return pairs[:, 0], pairs[:, 1]


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the kernel may back with 2 MiB pages (Linux THP).

    Decode attention reads blocks scattered over the whole cache, a few KiB each; with 4 KiB
    pages nearly every block costs TLB misses (measured here: decode attention at context 400,
    batch 64, 3-8% faster on huge pages; no change at context 64). The advice must come
    before the pages are first touched, hence empty, advise, then zero. Where it is refused
    (another OS, THP off) the tensor is just zeroed.
    """
    tensor = torch.empty(shape, dtype=dtype)
    size = tensor.numel() * tensor.element_size()
    if sys.platform.startswith("linux") and size >= 2 * _PAGE:
        start = tensor.data_ptr() // _PAGE * _PAGE
        length = tensor.data_ptr() + size - start
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return tensor.zero_()
