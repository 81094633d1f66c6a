"""Keeps per-sequence state from the scheduler's diffs and turns a step into tensors.

The scheduler sends each sequence's tokens once; afterwards only appended tokens, block-table
patches and scheduled counts. `ModelRunner` mirrors that state (`SequenceStates`, in
sequence_state.py, which the simulated worker of the fleet benchmark shares), lays the
step's tokens out prefill-first (sequences computing several tokens, then single-token ones),
has `step_inputs.prepare_inputs` build input ids, positions, slot mapping, block tables and
lengths (and, for a model with recurrent layers, the step's state slots), runs the model with
logits only for the rows that need them, and hands those to the sampler; a sequence decoding
several tokens a step (multi-step) gets a forward pass per token more.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from llmserve.kv_layout import NULL_BLOCK, KvLayout, single_group
from llmserve.steps import SequenceOutput, StepResult, TokenMask
from llmserve_kernels.cpu.decode import ArgmaxLogprobs
from worker_service import metrics as worker_metrics
from worker_service.attention.base import AttentionBackend
from worker_service.cuda_graphs import DecodeGraphs
from worker_service.linear_state import DraftRows
from worker_service.models.decoder import DecoderModel
from worker_service.prompt_logprobs import prompt_logprobs
from worker_service.sampler import Sampler, SamplingRow
from worker_service.sequence_state import Scheduled, SequenceStates, StateError
from worker_service.step_inputs import (
    InputGeometry,
    PreparedInputs,
    block_table,
    prepare_inputs,
    state_slot,
)

__all__ = ["ModelRunner", "StateError"]


class ModelRunner(SequenceStates):
    """Runs steps of one model over one KV cache."""

    def __init__(
        self,
        model: DecoderModel,
        backends: AttentionBackend | list[AttentionBackend],
        sampler: Sampler,
        block_size: int,
        layout: KvLayout | None = None,
    ) -> None:
        if layout is None:
            layout = single_group(model.arch.num_layers)
        super().__init__(block_size, len(layout.groups))
        self.layout = layout
        slot_of = layout.slot_of_layer()
        # A recurrent layer is in no group; the model reads no group of it.
        model.layer_groups = tuple(
            slot_of[i][0] if i in slot_of else 0 for i in range(model.arch.num_layers)
        )
        self.model = model
        # One backend per KV group (each keeps per-step state of its group's tables).
        self.backends = backends if isinstance(backends, list) else [backends]
        if len(self.backends) != len(layout.groups):
            raise ValueError(
                f"{len(self.backends)} attention backends for {len(layout.groups)} KV groups"
            )
        self.backend = self.backends[0]
        # A layer holding K/V: its cache's first dimension is the block count.
        self._kv_layer = layout.groups[0].layers[0]
        self.sampler = sampler
        self.device = model.device
        # Captured decode forwards (CUDA); None runs every step eagerly. Set by the worker.
        self.decode_graphs: DecodeGraphs | None = None
        # On a CUDA worker without graphs, why (`cuda_graphs.EAGER_*`): each step counts as
        # eager for it. None elsewhere. Set by the worker.
        self.graphs_off: str | None = None
        # The last step's time building its passes' inputs (the worker's prepare metric).
        self.prepare_ns = 0

    @property
    def geometry(self) -> InputGeometry:
        return InputGeometry(self.block_size, self.num_groups, self.num_state_slots, self.device)

    @torch.inference_mode()
    def run(
        self,
        scheduled: list[Scheduled],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        step_id: int,
        take_masks: Callable[[], tuple[list[TokenMask], int]] | None = None,
        passes_end: Callable[[], bool] | None = None,
    ) -> StepResult:
        """Steps 6 of the contract: forward over the scheduled tokens, then sample; then, for
        the sequences decoding several tokens (multi-step), a pass per token more, until
        `passes_end()` says the scheduler ended the step's runs early.
        `take_masks()`: the step's deferred masks and the ns spent waiting for them."""
        result = StepResult(step_id)
        self.prepare_ns = 0
        if not scheduled:
            return result
        outputs = last = self._pass(scheduled, kv_caches, step_id, result, take_masks)
        pending = [s for s in scheduled if s.own_steps]
        if pending:
            self.token_masks = {}
            outputs = list(outputs)
        while pending:
            if passes_end is not None and passes_end():
                self.end_passes(pending)
                worker_metrics.RUNS_ENDED.inc(len(pending))
                break
            passing = self.next_pass(pending, last)
            last = self._pass(passing, kv_caches, step_id, result, None)
            outputs.extend(last)
            pending = [s for s in passing if s.own_steps]
        result.outputs = outputs
        return result

    def _pass(
        self,
        scheduled: list[Scheduled],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        step_id: int,
        result: StepResult,
        take_masks: Callable[[], tuple[list[TokenMask], int]] | None,
    ) -> list[SequenceOutput]:
        """One forward pass over `scheduled` and its samples; adds its times to `result`."""
        t0 = time.perf_counter_ns()
        # Prefill-first layout; stable so the step order survives within each part.
        layout = sorted(scheduled, key=lambda s: s.is_decode)
        num_blocks = kv_caches[self._kv_layer][0].shape[0] if kv_caches else 0
        inputs = prepare_inputs(layout, num_blocks, self.geometry)
        self.prepare_ns += time.perf_counter_ns() - t0
        logits = None  # [num_logit_rows, vocab]
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run(
                inputs.input_ids, inputs.positions, inputs.metadata, inputs.logit_rows
            )
        elif self.graphs_off is not None:
            worker_metrics.EAGER_STEPS.labels(self.graphs_off).inc()
        if logits is None:
            logits = self.model.forward(
                inputs.input_ids,
                inputs.positions,
                kv_caches,
                inputs.metadatas if len(inputs.metadatas) > 1 else inputs.metadata,
                self.backends if len(self.backends) > 1 else self.backend,
                inputs.logit_rows,
                state_metadata=inputs.states,
            )
        for s in scheduled:
            s.state.num_computed += s.count
        t1 = time.perf_counter_ns()
        if self.masks_deferred:
            if take_masks is None:
                raise StateError(f"step {step_id} defers masks, and nothing delivers them")
            masks, waited = take_masks()
            result.mask_wait_ns += waited
            self.masks_deferred = False
            self.token_masks.update(((m.seq_id, m.row), m) for m in masks)
        else:
            waited = 0
        outputs = self._sample(logits, inputs, self.model.argmax_logprobs)
        result.forward_ns += t1 - t0
        result.sample_ns += time.perf_counter_ns() - t1 - waited
        return outputs

    def _sample(
        self,
        logits: torch.Tensor,
        inputs: PreparedInputs,
        argmax: ArgmaxLogprobs | None,  # of every logits row, when the forward found them
    ) -> list[SequenceOutput]:
        outputs: dict[int, list[SequenceOutput]] = {}
        if inputs.sample_items:
            # A row samples as if the tokens up to its position were the sequence's: a draft's
            # row sees the drafts before it as outputs (penalties, min_tokens, seeded streams).
            rows = [
                SamplingRow(
                    s.state.params,
                    s.state.seq_index,
                    tokens if len(tokens := s.state.token_ids) == p + 1 else tokens[: p + 1],
                    s.state.num_prompt_tokens,
                    # Its row among the sequence's sampling rows (0 unless drafts follow).
                    self.token_masks.get((s.state.seq_id, p - s.rows().start)),
                )
                for s, _, p in inputs.sample_items
            ]
            sample_rows = [r for _, r, _ in inputs.sample_items]
            sample_logits = logits
            if sample_rows != list(range(logits.shape[0])):  # else every logits row samples
                sample_logits = logits[torch.tensor(sample_rows, device=logits.device)]
                argmax = None
            for (s, _, _), res in zip(
                inputs.sample_items, self.sampler.sample(sample_logits, rows, argmax), strict=True
            ):
                out = SequenceOutput(s.state.seq_id, res.samples, res.top_logprobs)
                outputs.setdefault(s.order, []).append(out)
            draft_rows = inputs.states.draft_rows if inputs.states is not None else None
            for s, _, p in inputs.sample_items:
                if s.num_drafts and p == s.start + s.count - 1:  # its last row: settle drafts
                    outputs[s.order] = self._verify(s, outputs[s.order], draft_rows)
        for s, first_row, n, first_pos in inputs.prompt_items:
            positions = list(range(first_pos, first_pos + n))
            targets = [s.state.token_ids[p] for p in positions]
            s.state.pending_prompt_logprobs.extend(
                prompt_logprobs(
                    logits[first_row : first_row + n].float(),
                    positions,
                    targets,
                    s.state.params.prompt_logprobs or 0,
                )
            )
        for s, _, _ in inputs.sample_items:
            if s.state.pending_prompt_logprobs:
                outputs[s.order][0].prompt_logprobs = s.state.pending_prompt_logprobs
                s.state.pending_prompt_logprobs = []
        return [out for k in sorted(outputs) for out in outputs[k]]

    def _verify(
        self, s: Scheduled, samples: list[SequenceOutput], draft_rows: DraftRows | None
    ) -> list[SequenceOutput]:
        """Keep `s`'s drafts while each equals the sample taken at the position before it;
        returns the outputs of the tokens produced (the kept drafts, then the next sample).
        Each sample is drawn as a step without drafts would draw it, so the tokens produced
        are the ones such steps would have produced. A recurrent state goes back to the one
        after the last kept token (`draft_rows`, with recurrent layers)."""
        end = s.start + s.count
        drafts = s.state.token_ids[end - s.num_drafts : end]
        kept = 0
        while kept < len(drafts) and samples[kept].samples[0].token_id == drafts[kept]:
            kept += 1
        if draft_rows is not None and kept < len(drafts):
            draft_rows.restore(state_slot(s.state), kept)
        self.keep_drafts(s, kept)
        return samples[: kept + 1]

    def group_blocks_used(self) -> list[int]:
        """Device blocks each KV group's tables hold over the sequences held (a block shared
        by sequences counted once; the null block and stale entries before a window left
        out)."""
        bs = self.block_size
        used: list[set[int]] = [set() for _ in range(self.num_groups)]
        for state in self.states.values():
            for g, group in enumerate(self.layout.groups):
                table = block_table(state, g)
                # The first block the next computed position's window reads.
                first = group.first_live_block(state.num_computed, bs)
                used[g].update(table[first:])
        if self.layout.reserves_null_block:
            for blocks in used:
                blocks.discard(NULL_BLOCK)
        return [len(blocks) for blocks in used]
