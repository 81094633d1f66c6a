"""CUDA graphs for decode steps: one captured forward per decode batch size.

A decode step of a small model is hundreds of short kernel launches (SmolLM2: 30 layers of
norms, matmuls, rotary, cache write, attention), and on a GPU the host's launch time, not the
device, sets the step time. `DecodeGraphs` captures the model's forward once per batch size in
`capture_sizes` (1, 2, 4, 8, then every multiple of 8 up to the largest batch) over static
input buffers, and a decode step of `n` sequences replays the smallest captured size >= n with
its inputs copied into the first `n` rows.

Padding rows write no cache slot (slot -1) and attend to an empty context (length 0: the
decode kernel writes zeros for them); their logits are dropped. Captured kernels read the
block tables at their full width (`max_model_len` tokens) and split contexts as if every
sequence could be that long, so the split-K partitioning of a replay can differ from an eager
step's (float sums in another order; greedy output is compared in tests/integration).

Nothing in a captured forward may wait on the host: MoE layers run every expert, gated, while
a stream captures (worker_service/models/moe.py), since their grouped path counts tokens per
expert on the host.

The graphs hold the KV cache tensors they were captured with: capture after the cache is
allocated, and again whenever it is replaced. All graphs share one memory pool, captured from
the largest batch down, so their activations cost about what the largest one needs.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from worker_service import metrics as worker_metrics
from worker_service.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from llmserve.kv_layout import KvLayout
    from worker_service.models.decoder import DecoderModel

# Batch sizes captured below 8; from 8 on, every multiple of this step.
SMALL_SIZES = (1, 2, 4)
SIZE_STEP = 8


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes to capture, ascending: 1, 2, 4, 8, 16, ... up to `max_batch`
    (itself included when it is not a multiple of 8)."""
    if max_batch < 1:
        return []
    sizes = [s for s in SMALL_SIZES if s < max_batch]
    sizes += list(range(SIZE_STEP, max_batch, SIZE_STEP))
    return sizes + [max_batch]


def padded_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest of the ascending `sizes` that holds `num_seqs` rows, or None."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


# Why a step runs eagerly: the label of `llmserve_worker_eager_steps`.
EAGER_PREFILL = "prefill"  # the step computes a prompt chunk
EAGER_PARTIAL_LOGITS = "partial_logits"  # rows that sample are not every row, in order (drafts)
EAGER_WIDE_TABLES = "wide_tables"  # block tables wider than the captured ones
EAGER_TOO_MANY = "too_many_seqs"  # more decodes than the largest captured batch
EAGER_NOT_CAPTURED = "not_captured"  # its batch size has no graph (yet)
# Why a CUDA worker has no graphs at all (every step eager, counted under this reason).
EAGER_ENFORCED = "enforce_eager"  # --enforce-eager
EAGER_KV_LAYOUT = "kv_layout"  # see `layout_allows_graphs`


def graphs_off(enforce_eager: bool, layout: KvLayout) -> str | None:
    """Why a CUDA worker with this flag and layout captures no decode graphs
    (`EAGER_ENFORCED`, `EAGER_KV_LAYOUT`), or None when it captures them."""
    if enforce_eager:
        return EAGER_ENFORCED
    return None if layout_allows_graphs(layout) else EAGER_KV_LAYOUT


def layout_allows_graphs(layout: KvLayout) -> bool:
    """Whether a model laid out this way can replay decode graphs: they are captured over one
    set of block tables and no state pool, so a model with several KV groups (sliding windows
    beside full layers, shared or differently sized K/V) or linear-attention state decodes
    eagerly."""
    return len(layout.groups) == 1 and not layout.has_states


def eager_reason(
    sizes: list[int],
    max_blocks: int,
    *,
    num_prefills: int,
    num_decodes: int,
    num_logit_rows: int,
    table_width: int,
) -> str | None:
    """Why a step of this shape cannot replay a graph captured for `sizes` (ascending) over
    block tables `max_blocks` wide, or None when one replays it."""
    if num_prefills or num_decodes == 0:
        return EAGER_PREFILL
    if num_logit_rows != num_decodes:
        return EAGER_PARTIAL_LOGITS
    if table_width > max_blocks:
        return EAGER_WIDE_TABLES
    if not sizes or num_decodes > sizes[-1]:
        return EAGER_TOO_MANY
    return None


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [batch, vocab], written by every replay


class DecodeGraphs:
    """Captured decode forwards of one model over one KV cache (see the module docstring)."""

    def __init__(
        self,
        model: DecoderModel,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        max_batch: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        device = model.device
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = -(-max_model_len // block_size)
        n = max_batch

        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids = zeros(n, dtype=torch.int64)  # [max_batch]
        self.positions = zeros(n, dtype=torch.int64)  # [max_batch]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [max_batch]
        self.seq_lens = zeros(n, dtype=torch.int32)  # [max_batch]
        self.block_tables = zeros(n, self.max_blocks, dtype=torch.int32)  # [max_batch, max_blocks]
        self.logit_rows = torch.arange(n, dtype=torch.int64, device=device)  # [max_batch]
        # A graph's replay reads the tensors its metadata held at capture: made here, outside
        # every capture, and kept as long as the graphs.
        self._metadata = {batch: self._decode_metadata(batch) for batch in self.sizes}
        self.graphs: dict[int, _Graph] = {}
        self.replays = 0  # steps served by a graph (tests and logs)

    def _decode_metadata(self, batch: int) -> AttentionMetadata:
        """Decode-only metadata over the first `batch` rows of the static buffers."""
        return AttentionMetadata.for_decodes(
            slot_mapping=self.slot_mapping[:batch],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    def _forward(self, batch: int) -> torch.Tensor:  # [batch, vocab]
        return self.model.forward(
            self.input_ids[:batch],
            self.positions[:batch],
            self.kv_caches,
            self._metadata[batch],
            self.backend,
            self.logit_rows[:batch],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one shared memory pool. Each size runs
        once eagerly first, so that Triton compiles its kernel variants (scalar arguments
        of 1 specialize them) outside the capture. The inputs are padding rows only (no cache
        write, empty contexts), so capturing leaves the cache as it was."""
        device = self.model.device
        pool = torch.cuda.graph_pool_handle()
        # One side stream for every warm-up: the allocator caches memory per stream.
        stream = torch.cuda.Stream(device)
        for batch in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                self._forward(batch)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(batch)
            self.graphs[batch] = _Graph(graph, logits)
        torch.cuda.synchronize(device)

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured batch size a step of `num_seqs` decodes replays, or None (too many)."""
        return padded_size(self.sizes, num_seqs)

    def run(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: AttentionMetadata,
        logit_rows: torch.Tensor,  # [num_logit_rows] int64
    ) -> torch.Tensor | None:  # [num_tokens, vocab], or None: run this step eagerly
        """Replay the graph for a decode-only step in which every row samples, in order;
        None when the step is not one (`eager_reason` says why; the worker's
        `llmserve_worker_eager_steps` counts it by reason)."""
        n = metadata.num_decodes
        tables = metadata.decode_block_tables  # [n, width]
        reason = eager_reason(
            self.sizes,
            self.max_blocks,
            num_prefills=metadata.num_prefills,
            num_decodes=n,
            num_logit_rows=logit_rows.shape[0],
            table_width=tables.shape[1],
        )
        batch = self.padded_size(n)
        if reason is None and batch not in self.graphs:
            reason = EAGER_NOT_CAPTURED
        if reason is not None:
            worker_metrics.EAGER_STEPS.labels(reason).inc()
            return None
        assert batch is not None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.decode_seq_lens)
        self.block_tables[:n, : tables.shape[1]].copy_(tables)
        if batch > n:
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].fill_(0)
        entry = self.graphs[batch]
        entry.graph.replay()
        self.replays += 1
        worker_metrics.GRAPH_STEPS.inc()
        return entry.logits[:n]
