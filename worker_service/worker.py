"""The worker: loads the model, owns the KV cache, and executes the scheduler's steps."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from llmserve.batch_limits import BatchLimits, GivenBatchLimits, adopt_batch_limits
from llmserve.gguf_files import reading_gguf_once
from llmserve.logs import get_logger
from llmserve.model_spec import memoize_gguf_name_maps, resolve_model
from llmserve.steps import StepInput, StepResult, TokenMask
from worker_service import cuda_graphs, metrics
from worker_service.cache_engine import CacheEngine, cache_block_size_bytes
from worker_service.config import WorkerConfig
from worker_service.cuda_graphs import DecodeGraphs
from worker_service.exports import Exports
from worker_service.heap import return_freed_heap
from worker_service.kv_transfer import import_blocks
from worker_service.linear_state import StatePools, StateShapes
from worker_service.model_info import ModelInfo
from worker_service.model_runner import ModelRunner
from worker_service.model_setup import set_up_model
from worker_service.models import DecoderModel, mxfp4

log = get_logger(__name__)

# Left out of the KV cache beyond the profiled peak: device memory that appears outside
# torch's allocator later (CUDA modules loaded on first use, new streams' workspaces); a
# worker without it ended over budget (bench/RESULTS.md, "Figures moved out of code comments").
PROFILE_HEADROOM_BYTES = 64 << 20


class WorkerNotReadyError(RuntimeError):
    """A method was called before `load_model` / `initialize_cache`."""


class Worker:
    """One model copy on one device. Usage: `load_model()`, `determine_num_available_blocks()`,
    `initialize_cache(gpu, cpu)`, then `execute(step)` per iteration (an `Executor`). The
    profile run and the decode graphs are sized by `batch_limits`: the config's own until
    `use_batch_limits` gives the scheduler's.

    On CPU, construct it and call every method on one thread. The OpenMP thread count that
    torch uses (the C++ kernels have threads of their own, pool.h) is a per-thread setting,
    and libgomp, once more of its threads exist than cores (a second thread that ran a
    parallel region brings its own team), stops spin-waiting at barriers and sleeps instead:
    decode steps were slower when the model was loaded on one thread and run on another
    (bench/RESULTS.md, "Serving: llmserve vs HF `transformers serve`").
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.resolve_dtype(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
        self._thread = threading.get_ident()
        self._warned_thread = False
        # The last step's forward pass as (start, end) in time.perf_counter_ns(); None when it
        # computed nothing. The server measures the gap between forward passes from it.
        self.last_forward_ns: tuple[int, int] | None = None
        # The last step's host time before its model call (metrics.PREPARE_SECONDS).
        self.last_prepare_ns = 0
        self._model: DecoderModel | None = None
        self._info: ModelInfo | None = None
        self._runner: ModelRunner | None = None
        self.cache_engine: CacheEngine | None = None
        # Blocks peers may read (ExecuteRequest.exports), kept until released or a new cache.
        self.exports = Exports()
        self._kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # What the decode CUDA graphs were measured to keep (determine_num_available_blocks).
        self.graph_memory_bytes = 0
        # The largest step: what the profile run and the decode graphs are sized for.
        self.batch_limits = config.given_batch_limits.or_defaults()

    # -- loading ---------------------------------------------------------------------------
    def load_model(self) -> None:
        from transformers import AutoModelForCausalLM

        source = resolve_model(self.config.model)
        if source.gguf_file:
            memoize_gguf_name_maps()
        # A GGUF file's header is parsed once for transformers' config and weights and for
        # our blocks (llmserve/gguf_files.py: four parses otherwise, each a slow one).
        with reading_gguf_once():
            if not source.gguf_file and mxfp4.is_mxfp4_checkpoint(source.path):
                hf_model = mxfp4.load_dequantized(source.path, self.dtype)
            else:
                hf_model = AutoModelForCausalLM.from_pretrained(
                    source.path, **source.pretrained_kwargs(), dtype=self.dtype
                )
            self.load_from_hf(hf_model)
        del hf_model
        return_freed_heap()

    def load_from_hf(self, hf_model: Any) -> None:
        """Take the weights of an already-loaded transformers model (tests, benchmarks)."""
        self._check_thread()
        loaded = set_up_model(self.config, self.device, self.dtype, hf_model)
        self._model, self._info, self._runner = loaded.model, loaded.info, loaded.runner
        metrics.WEIGHT_BYTES.labels(format=loaded.info.weight_format).set(loaded.info.weight_bytes)

    @property
    def model_info(self) -> ModelInfo:
        if self._info is None:
            raise WorkerNotReadyError("load_model() first")
        return self._info

    @property
    def model(self) -> DecoderModel:
        if self._model is None:
            raise WorkerNotReadyError("load_model() first")
        return self._model

    @property
    def runner(self) -> ModelRunner:
        if self._runner is None:
            raise WorkerNotReadyError("load_model() first")
        return self._runner

    # -- KV cache --------------------------------------------------------------------------
    def get_cache_block_size_bytes(self) -> int:
        return cache_block_size_bytes(
            self.model_info.kv_layout, self.config.block_size, self.kv_dtype
        )

    @property
    def kv_dtype(self) -> torch.dtype:
        """The K/V cache's dtype (`WorkerConfig.kv_cache_dtype`; the model's by default)."""
        dtype = getattr(torch, self.model_info.cache_dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    @property
    def num_state_slots(self) -> int:
        """State slots of the recurrent layers: one per sequence a step may hold (the batch
        limit), none for a model without such layers."""
        return self.batch_limits.max_num_seqs if self.model_info.kv_layout.has_states else 0

    def state_bytes(self) -> int:
        """Device bytes of the `num_state_slots` state slots (as many again on the host)."""
        shapes = StateShapes.of(self.model.arch)
        if shapes is None:
            return 0
        layers = len(self.model_info.kv_layout.state_layers)
        return self.num_state_slots * shapes.slot_bytes(layers, self.dtype)

    def group_blocks_used(self) -> list[int]:
        """Device blocks each KV group's tables hold now, over the sequences this worker
        holds (a block shared by sequences counted once; the null block not counted)."""
        if self._runner is None:
            return []
        return self.runner.group_blocks_used()

    def determine_num_available_blocks(self) -> tuple[int, int]:
        """(device blocks, host swap blocks). CUDA: profile a forward of the largest step under
        `batch_limits` and give the KV cache what is left of `gpu_memory_utilization`; CPU:
        from `kv_cache_memory_bytes`. The recurrent layers' state slots come out of the same
        memory first, and their host slots out of the swap space. Call it with no cache
        allocated."""
        block_bytes = self.get_cache_block_size_bytes()
        num_host = max(self.config.swap_space_bytes - self.state_bytes(), 0) // block_bytes
        if self.device.type != "cuda":
            kv_bytes = self.config.kv_cache_memory_bytes - self.state_bytes()
            return max(kv_bytes // block_bytes, 0), num_host
        torch.cuda.empty_cache()
        # The decode graphs, captured over a one-block throwaway cache, stay alive through the
        # profile run, so that what they hold (their memory pool, the warm-ups' blocks cached
        # for their stream, the instantiated graphs outside torch's allocator) is inside the
        # measured peak, beside a largest step, as it will be while serving. (Their footprint
        # added to a peak profiled without them left the device over its budget once the
        # cache was allocated: bench/RESULTS.md, "The GPU path on an H100: kernels, CUDA
        # graphs, serving".)
        probe = self._probe_graphs()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory others hold on this device (and the CUDA context, cuBLAS workspaces, graphs:
        # memory outside torch's allocator) plus our own peak during the profile run.
        used_by_others = total - free - torch.cuda.memory_reserved(self.device)
        # Reserved, not allocated: the allocator's rounding and fragmentation are memory too.
        peak = torch.cuda.max_memory_reserved(self.device) + max(used_by_others, 0)
        peak += PROFILE_HEADROOM_BYTES
        available = int(total * self.config.gpu_memory_utilization) - peak - self.state_bytes()
        del probe
        torch.cuda.empty_cache()
        return max(available // block_bytes, 0), num_host

    def _graphs_off(self) -> str | None:
        """On CUDA, why this worker captures no decode graphs (`cuda_graphs.graphs_off`), or
        None when it does; None elsewhere too (there are none to count)."""
        if self.device.type != "cuda":
            return None
        return cuda_graphs.graphs_off(self.config.enforce_eager, self.model_info.kv_layout)

    def _graphs_enabled(self) -> bool:
        return self.device.type == "cuda" and self._graphs_off() is None

    def _probe_graphs(self) -> tuple[DecodeGraphs, CacheEngine] | None:
        """The decode graphs captured over a one-block throwaway cache (None when eager);
        sets `graph_memory_bytes` to the device memory their capture took."""
        if not self._graphs_enabled():
            return None
        cache = self._new_cache(1, 0)
        torch.cuda.synchronize(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        graphs = self._capture_graphs(cache.layer_caches())
        torch.cuda.synchronize(self.device)
        self.graph_memory_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        return graphs, cache

    def _capture_graphs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> DecodeGraphs:
        graphs = DecodeGraphs(
            self.model,
            self.runner.backend,
            kv_caches,
            max_batch=self.batch_limits.max_num_seqs,
            max_model_len=self.model_info.max_model_len,
            block_size=self.config.block_size,
        )
        graphs.capture()
        return graphs

    def _profile_run(self) -> None:
        """One forward over max_num_batched_tokens tokens split among max_num_seqs prompts
        (the batch limits), with a throwaway cache just large enough for it."""
        from llmserve.sampling_params import SamplingParams
        from llmserve.steps import NewSequence

        limits, bs = self.batch_limits, self.config.block_size
        num_seqs = min(limits.max_num_seqs, limits.max_num_batched_tokens)
        lengths = [limits.max_num_batched_tokens // num_seqs] * num_seqs
        slots = num_seqs if self.model_info.kv_layout.has_states else 0
        cache = self._new_cache(sum(-(-n // bs) for n in lengths), 0, slots)
        # Every group writes the same blocks: the throwaway cache's contents do not matter.
        other_groups = len(self.model_info.kv_layout.groups) - 1
        step, next_block = StepInput(step_id=-1), 0
        for i, n in enumerate(lengths):
            nb = -(-n // bs)
            step.new_seqs.append(
                NewSequence(
                    i,
                    f"profile-{i}",
                    0,
                    [0] * n,
                    n,
                    0,
                    list(range(next_block, next_block + nb)),
                    n,
                    SamplingParams(temperature=1.0, top_p=0.9, top_k=50),
                    group_block_ids=[list(range(next_block, next_block + nb))] * other_groups,
                    state_slot=i if slots else None,
                )
            )
            next_block += nb
        runner = self.runner
        runner.num_state_slots = slots
        try:
            scheduled = runner.apply_updates(step)
            runner.run(scheduled, cache.layer_caches(), step.step_id)
        finally:
            runner.states.clear()
            runner.num_state_slots = 0
        del cache

    def batch_limits_for(self, sent: GivenBatchLimits) -> BatchLimits:
        """The batch limits to run under when a scheduler sends `sent`: see
        `adopt_batch_limits` (raises FieldError when this worker's flags disagree)."""
        return adopt_batch_limits(self.config.given_batch_limits, sent)

    def use_batch_limits(self, limits: BatchLimits) -> tuple[int, int]:
        """Size the profile run and the decode graphs for `limits` from now on: drops the
        cache (its graphs were captured for the old limits; on CUDA the profile needs its
        memory) and returns `determine_num_available_blocks()` under the new limits."""
        self._check_thread()
        self._drop_cache()
        previous, self.batch_limits = self.batch_limits, limits
        try:
            return self.determine_num_available_blocks()
        except BaseException:  # the blocks offered stay those profiled for `previous`
            self.batch_limits = previous
            raise

    def _new_cache(
        self, num_gpu_blocks: int, num_cpu_blocks: int, num_state_slots: int = 0
    ) -> CacheEngine:
        arch = self.model.arch
        layout = self.model_info.kv_layout
        shapes = StateShapes.of(self.model.arch)
        states = None
        if shapes is not None:
            states = StatePools(
                layout.state_layers, shapes, num_state_slots, self.dtype, self.device
            )
        state_layers = set(arch.linear_layers)
        return CacheEngine(
            self.model_info.kv_layout,
            [None if i in state_layers else arch.kv_shape(i) for i in range(arch.num_layers)],
            self.config.block_size,
            num_gpu_blocks,
            num_cpu_blocks,
            self.kv_dtype,
            self.device,
            states,
        )

    def _drop_cache(self) -> None:
        """Drop the cache, the graphs that hold its tensors, and the sequences and exports
        that lived in it."""
        self.runner.decode_graphs = None
        self.cache_engine = None
        self._kv_caches = []
        self.runner.states.clear()
        self.runner.num_state_slots = 0
        self.exports.clear()

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate the cache: these blocks, and `num_state_slots` state slots."""
        self._check_thread()
        self._drop_cache()  # before allocating the new one
        slots = self.num_state_slots
        self.cache_engine = self._new_cache(num_gpu_blocks, num_cpu_blocks, slots)
        self.runner.num_state_slots = slots
        self._kv_caches = self.cache_engine.layer_caches()
        self.runner.graphs_off = self._graphs_off()
        if self._graphs_enabled():
            start = time.perf_counter()
            self.runner.decode_graphs = self._capture_graphs(self._kv_caches)
            log.info(
                "captured decode CUDA graphs",
                batch_sizes=len(self.runner.decode_graphs.sizes),
                max_batch=self.batch_limits.max_num_seqs,
                seconds=round(time.perf_counter() - start, 2),
            )

    def _check_thread(self) -> None:
        if (
            self.device.type == "cpu"
            and threading.get_ident() != self._thread
            and not self._warned_thread
        ):
            self._warned_thread = True
            log.warning(
                "worker called from a thread other than the one that constructed it; "
                "on CPU every step slows down (see Worker)",
                constructed_on=self._thread,
                called_on=threading.get_ident(),
            )

    # -- execution -------------------------------------------------------------------------
    def execute(
        self,
        step: StepInput,
        take_masks: Callable[[], tuple[list[TokenMask], int]] | None = None,
        passes_end: Callable[[], bool] | None = None,
    ) -> StepResult:
        """Apply one step in the order fixed by `llmserve.steps`. `take_masks()` gives the
        step's deferred masks (and the ns it waited for them) once the forward pass is done;
        `passes_end()`, asked between the passes of multi-step runs, whether they end early."""
        self._check_thread()
        if self.cache_engine is None:
            raise WorkerNotReadyError("initialize_cache() first")
        entered = time.perf_counter_ns()
        runner = self.runner
        self.exports.apply(step)
        imported, failed = import_blocks(self.cache_engine, step.imports)
        scheduled = runner.apply_updates(step)
        states = self.cache_engine.states
        if states is not None:  # forks, swaps, then prefix hits (`llmserve.steps`)
            states.copy(runner.fork_copies)
            states.swap_out(step.states_to_swap_out)
            states.swap_in(step.states_to_swap_in)
            states.copy(runner.state_copies)
        self.cache_engine.swap_out(step.blocks_to_swap_out)
        self.cache_engine.swap_in(step.blocks_to_swap_in)
        self.cache_engine.copy_blocks(step.blocks_to_copy)
        start = time.perf_counter_ns()
        result = runner.run(scheduled, self._kv_caches, step.step_id, take_masks, passes_end)
        if self.cache_engine.states is not None:
            self.cache_engine.states.copy(step.state_saves)
        # The forward pass (input preparation and the model call) starts `run`; sampling follows.
        self.last_forward_ns = (start, start + result.forward_ns) if scheduled else None
        self.last_prepare_ns = start - entered + runner.prepare_ns
        runner.remember_samples(scheduled, result)
        result.imported_transfer_ids, result.failed_imports = imported, failed
        return result

    @property
    def num_sequences(self) -> int:
        """Sequences whose state this worker holds (0 once every request is finished)."""
        return len(self.runner.states)
