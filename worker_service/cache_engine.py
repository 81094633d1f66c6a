"""The paged KV cache of one worker: device blocks, host swap blocks, and block moves.

Layout. One allocation `[num_blocks, 2, slots, block_size, unit]` in the model dtype holds
every layer's keys (index 0) and values (index 1): block-major, so a block id addresses one
contiguous chunk that a swap, copy or transfer moves whole, whatever KV group holds it
(`llmserve.kv_layout`: a block given to a group holds its j-th layer in the group's slots
from `first_slot(j)`, `units` of them). A layer's key cache is a view
`[num_blocks, block_size, num_kv_heads, head_dim]` of its slots: token-major inside a block
so writing one token's K (all kv heads) is one contiguous store, head_dim innermost for the
dot products, blocks `block_stride` elements apart (the whole block of all slots, K and V).
Layers of different widths (Gemma 4's two head sizes) take different numbers of slots of the
same blocks, so they share one pool.

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


KvShape = tuple[int, int]  # a layer's (num_kv_heads, head_dim)


def cache_block_size_bytes(layout: KvLayout, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across its slots (K and V)."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * layout.slots * block_size * layout.unit * element_size


class CacheEngine:
    """Owns the device KV cache and the host swap space of one worker."""

    def __init__(
        self,
        layout: KvLayout,
        kv_shapes: list[KvShape | None],  # per layer; None for a recurrent layer
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        states: StatePools | None = None,  # the recurrent layers' slots, if the model has any
    ) -> None:
        if (states is None) != (not layout.state_layers):
            raise ValueError("state pools are given exactly when the layout has state layers")
        if len(kv_shapes) != layout.num_layers:
            raise ValueError(f"{len(kv_shapes)} K/V shapes for {layout.num_layers} layers")
        self.layout = layout
        self.kv_shapes = kv_shapes
        self.states = states
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_host_blocks = num_host_blocks
        self.dtype = dtype
        self.device = device
        block = (2, layout.slots, block_size, layout.unit)
        # Zeroed, not empty: backends read (and mask) the tail of a sequence's last block, and
        # masked garbage must still be finite so that 0 * value stays 0.
        device_shape = (num_device_blocks, *block)
        if device.type == "cpu":
            self.device_cache = _zeros_on_huge_pages(device_shape, dtype)
        else:
            self.device_cache = torch.zeros(device_shape, dtype=dtype, device=device)
        # device_cache: [num_device_blocks, 2, slots, block_size, unit]
        # Empty, not zeroed: a host block is read only by swap_in, after a swap_out wrote the
        # whole block, so nothing reads what it held before. (Zeroing the default cache took
        # seconds of a CPU worker's InitializeCache, touching every page up front:
        # bench/RESULTS.md, "Figures moved out of code comments".)
        self.host_cache = torch.empty(
            (num_host_blocks, *block), dtype=dtype, pin_memory=device.type == "cuda"
        )  # [num_host_blocks, 2, slots, block_size, unit]

    def layer_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads,
        head_dim] with blocks `block_stride` apart: the views of its slots; a recurrent
        layer's (conv, recurrent) state pools."""
        slot_of = self.layout.slot_of_layer()
        pools = {} if self.states is None else self.states.layer_pools()
        caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i in range(self.layout.num_layers):
            if i in pools:
                caches.append(pools[i])
                continue
            group, first = slot_of[i]
            units = self.layout.groups[group].units
            shape = self.kv_shapes[i]
            assert shape is not None, f"layer {i} holds K/V but has no shape"
            keys = self._layer_view(0, first, units, shape)
            caches.append((keys, self._layer_view(1, first, units, shape)))
        return caches

    def _layer_view(self, kv: int, first: int, units: int, shape: KvShape) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim] over slots [first, first + units)
        of the keys (kv 0) or values (1)."""
        num_kv_heads, head_dim = shape
        if num_kv_heads * head_dim != units * self.layout.unit:
            raise ValueError(
                f"K/V shape {num_kv_heads} x {head_dim} does not fill {units} slots of "
                f"{self.layout.unit} elements"
            )
        slots = self.device_cache[:, kv, first : first + units]  # [blocks, units, bs, unit]
        return slots.view(self.num_device_blocks, self.block_size, num_kv_heads, head_dim)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks, (device src, host dst) pairs, all layers."""
        if mapping:
            src, dst = self._split(mapping)
            self.host_cache[dst] = self.device_cache[src.to(self.device)].to("cpu")

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks to device blocks, (host src, device dst) pairs, all layers."""
        if mapping:
            src, dst = self._split(mapping)
            moved = self.host_cache[src].to(self.device, non_blocking=True)
            self.device_cache[dst.to(self.device)] = moved

    def copy_blocks(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to device blocks (copy-on-write), (src, dst) pairs, all slots."""
        if mapping:
            src, dst = self._split(mapping)
            src, dst = src.to(self.device), dst.to(self.device)
            self.device_cache[dst] = self.device_cache[src]

    @property
    def block_bytes(self) -> int:
        """Bytes of one device block across its slots, K and V."""
        return self.block_stride * self.device_cache.element_size()

    @property
    def block_stride(self) -> int:
        """Elements from one block to the next, in every layer's view."""
        return self.device_cache[0].numel()

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A contiguous host copy of device blocks in the cache's own layout: [n, 2, slots,
        block_size, unit] (one gather, no reordering)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return self.device_cache[index].to("cpu")

    def write_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Store blocks laid out as `read_blocks` returns them into device blocks."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.device_cache[index] = blocks.to(self.device)

    @staticmethod
    def _split(mapping: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = torch.tensor(mapping, dtype=torch.int64)  # [num_pairs, 2]
        return pairs[:, 0], pairs[:, 1]


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory the kernel may back with 2 MiB pages (Linux THP).

    Decode attention reads blocks scattered over the whole cache, a few KiB each; with 4 KiB
    pages nearly every block costs TLB misses (decode attention at long contexts is faster on
    huge pages, at short ones no different: bench/RESULTS.md, "Offline throughput" and
    "Figures moved out of code comments"). The advice must come before the pages are first
    touched, hence empty, advise, then zero. Where it is refused (another OS, THP off) the
    tensor is just zeroed.
    """
    tensor = torch.empty(shape, dtype=dtype)
    size = tensor.numel() * tensor.element_size()
    if sys.platform.startswith("linux") and size >= 2 * _PAGE:
        start = tensor.data_ptr() // _PAGE * _PAGE
        length = tensor.data_ptr() + size - start
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_HUGEPAGE)
    return tensor.zero_()
