"""Factories for worker tests: workers over tiny models (tests/support/models.py), hand-built
steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from llmserve.sampling_params import SamplingParams
from llmserve.steps import CachedSequence, NewSequence, StepInput, TableEdit
from worker_service.config import WorkerConfig
from worker_service.worker import Worker

BLOCK_SIZE = 4


def make_worker(
    path: Path | str, num_blocks: int = 64, num_host_blocks: int = 16, **config: Any
) -> Worker:
    worker = Worker(WorkerConfig(model=str(path), block_size=BLOCK_SIZE, num_threads=1, **config))
    worker.load_model()
    worker.initialize_cache(num_blocks, num_host_blocks)
    return worker


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_logprobs(hf_model: Any, tokens: list[int]) -> torch.Tensor:  # [len(tokens), vocab]
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def blocks_for(first: int, num_tokens: int) -> list[int]:
    return list(range(first, first + -(-num_tokens // BLOCK_SIZE)))


def new_seq(
    seq_id: int,
    tokens: list[int],
    block_ids: list[int],
    scheduled: int | None = None,
    computed: int = 0,
    params: SamplingParams | None = None,
    seq_index: int = 0,
    num_prompt_tokens: int | None = None,
) -> NewSequence:
    return NewSequence(
        seq_id=seq_id,
        request_id=f"req-{seq_id}",
        seq_index=seq_index,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens) if num_prompt_tokens is None else num_prompt_tokens,
        num_computed_tokens=computed,
        block_ids=block_ids,
        num_scheduled_tokens=len(tokens) - computed if scheduled is None else scheduled,
        sampling_params=params or SamplingParams(temperature=0.0, max_tokens=64),
    )


class GreedyDriver:
    """A minimal hand-written scheduler for runner tests: contiguous blocks per sequence,
    decode one token at a time, append blocks as needed. A model laid out in several KV groups
    gets blocks of its own in each (windows keep every block: correct, if wasteful)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.num_groups = len(worker.model_info.kv_layout.groups)
        self.step_id = 0
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[int]] = {}  # KV group 0's
        self.group_blocks: dict[int, list[list[int]]] = {}  # groups 1, 2, ...
        # Block 0 is the null block of a layout with windows: never handed out.
        self.next_block = int(worker.model_info.kv_layout.reserves_null_block)
        self.next_block = 0
        self.outputs: dict[int, list[int]] = {}

    def alloc(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def step(self, step: StepInput) -> dict[int, int]:
        step.step_id = self.step_id
        self.step_id += 1
        result = self.worker.execute(step)
        sampled = {o.seq_id: o.samples[0].token_id for o in result.outputs}
        for seq_id, token in sampled.items():
            self.outputs.setdefault(seq_id, []).append(token)
        return sampled

    def decode_step(self, sampled: dict[int, int]) -> StepInput:
        cached = []
        for seq_id, token in sampled.items():
            toks = self.tokens[seq_id]
            toks.append(token)
            offset = len(self.blocks[seq_id])
            grow = len(toks) > offset * BLOCK_SIZE
            new_blocks = self.alloc(1) if grow else []
            self.blocks[seq_id].extend(new_blocks)
            update = CachedSequence(seq_id, [token], offset, new_blocks, 1)
            for table in self.group_blocks[seq_id]:
                edit = TableEdit(len(table), self.alloc(1) if grow else [])
                table.extend(edit.block_ids)
                update.group_edits.append(edit)
            cached.append(update)
        return StepInput(0, cached_seqs=cached)

    def run_greedy(
        self, prompts: dict[int, list[int]], max_new_tokens: int
    ) -> dict[int, list[int]]:
        news = []
        for seq_id, prompt in prompts.items():
            self.tokens[seq_id] = list(prompt)
            num_blocks = -(-len(prompt) // BLOCK_SIZE)
            self.blocks[seq_id] = self.alloc(num_blocks)
            self.group_blocks[seq_id] = [self.alloc(num_blocks) for _ in range(self.num_groups - 1)]
            new = new_seq(seq_id, prompt, list(self.blocks[seq_id]))
            new.group_block_ids = [list(t) for t in self.group_blocks[seq_id]]
            news.append(new)
        sampled = self.step(StepInput(0, new_seqs=news))
        for _ in range(max_new_tokens - 1):
            sampled = self.step(self.decode_step(sampled))
        return self.outputs
