"""A deterministic fake model that executes `StepInput`s like a worker would.

It rebuilds every sequence only from the step diffs, keeps a simulated KV cache (the token id
stored in each slot of each device and host block), writes computed tokens through the block
table, applies swaps and copies, and derives the next token from the tokens it READS BACK
from its cache. A wrong diff, block table, swap or copy therefore changes the output.

With KV groups (`windows`, as `llmserve.kv_layout` lays a hybrid model out) it writes every
token through each group's table and reads a windowed group back only over its window, as
attention would: a block freed while its window still reads it, or one never written, changes
the output; a write into the null block fails at once.

With state slots (`num_state_slots`, a model with recurrent layers) it also keeps, per slot, a
running hash of the tokens its sequence computed, as a recurrent layer keeps its state: a
sequence starting from its first token starts it afresh, a fork copies it, a prefix hit
starts from a copy of its snapshot (saved after the step that reached it), and every sample
depends on it; drafts a step drops leave no trace in it, as the worker puts the state back. A
slot shared by two live sequences, a fork that does not copy, or a snapshot of another prefix
changes the output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llmserve.kv_layout import NULL_BLOCK
from llmserve.sampling_params import SamplingParams
from llmserve.steps import (
    SAMPLED_TOKEN,
    PromptLogprob,
    SequenceOutput,
    StepInput,
    StepResult,
    TableEdit,
    TokenLogprob,
    TokenMask,
    TransferFailure,
)

_MASK = (1 << 61) - 1


def _mix(h: int, x: int) -> int:
    return ((h ^ (x + 0x9E3779B97F4A7C15)) * 0x100000001B3) & _MASK


def _mix_all(h: int, xs: list[int]) -> int:
    for x in xs:
        h = _mix(h, x)
    return h


@dataclass(slots=True)
class _SeqState:
    request_id: str
    seq_index: int
    tokens: list[int]
    num_prompt_tokens: int
    num_computed: int
    table: list[int]  # KV group 0's
    params: SamplingParams
    # KV groups 1, 2, ...
    group_tables: list[list[int]]
    # What the last step that scheduled it sampled (for SAMPLED_TOKEN), if it sampled one
    # (after drafts: the last token of the run).
    last_sampled: int | None = None
    # Whether the last step that verified its drafts dropped some, or ended its multi-step
    # run early (an update `after_drafts` is then skipped but for its block table).
    drafts_cut: bool = False
    state_slot: int | None = None


class FakeModel:
    """Implements `Executor`. Next token = f(hash of the cached context, seq index)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        vocab_size: int = 64,
        windows: tuple[int | None, ...] = (None,),
        num_state_slots: int = 0,
    ) -> None:
        self.block_size = block_size
        # Per state slot, the running hash of the tokens its sequence computed; the host's.
        self.state_slots: list[int] = [0] * num_state_slots
        self.host_state_slots: list[int] = [0] * num_state_slots
        self.windows = windows
        self.vocab_size = vocab_size
        self.gpu: list[list[int | None]] = [[None] * block_size for _ in range(num_gpu_blocks)]
        self.cpu: list[list[int | None]] = [[None] * block_size for _ in range(num_cpu_blocks)]
        self.seqs: dict[int, _SeqState] = {}
        self.num_steps = 0
        self.num_computed_tokens = 0
        self.num_placeholders = 0
        # Placeholders followed by known tokens (forced ones).
        self.num_placeholder_runs = 0
        self.num_masked_rows = 0
        self.num_drafts_kept = 0
        # Tokens computed in multi-step passes after a step's first.
        self.num_own_steps = 0
        # Asked before each multi-step pass after a step's first, as the worker asks whether
        # the scheduler ended the runs (`ExecuteRequest.end_passes`); None: never ended.
        self.passes_end: Callable[[], bool] | None = None
        self.num_runs_ended = 0
        # Token masks of rows after a draft (speculative decoding under a grammar).
        self.num_masked_draft_rows = 0
        # Updates `after_drafts` computed (their step kept every draft) and skipped.
        self.num_after_drafts = 0
        self.num_skipped_after_drafts = 0
        # KV transfers: blocks exported by transfer id, and the peers imports read from (by
        # address, set by the test). An import copies the peer's simulated slots.
        self.exports: dict[int, list[int]] = {}
        self.peers: dict[str, FakeModel] = {}
        self.fail_imports = False
        self.num_imports = 0  # imports done

    # -- the model's "distribution" -------------------------------------------------------

    def _logprob(self, h: int, token_id: int) -> float:
        return -0.05 - (_mix(h, token_id) % 4096) / 1024.0

    def _top(self, h: int, k: int) -> list[TokenLogprob]:
        base = h % self.vocab_size
        return [
            TokenLogprob(
                (base + j) % self.vocab_size, self._logprob(h, (base + j) % self.vocab_size), j + 1
            )
            for j in range(k)
        ]

    def _sample(self, h: int, seq_index: int, allowed: list[int] | None = None) -> TokenLogprob:
        """A token drawn from the whole vocabulary, or from `allowed` (a token mask)."""
        if allowed is None:
            token = _mix(h, 1000 + seq_index) % self.vocab_size
        else:
            token = allowed[_mix(h, 1000 + seq_index) % len(allowed)]
        return TokenLogprob(token, self._logprob(h, token), 1)

    def _beam_candidates(
        self, h: int, width: int, allowed: list[int] | None = None
    ) -> list[TokenLogprob]:
        base = h % self.vocab_size
        if allowed is not None:  # under a mask: the best allowed tokens, maybe fewer
            cands = sorted(allowed, key=lambda t: -self._logprob(h, t))[:width]
        else:
            cands = [(base + 3 * j) % self.vocab_size for j in range(width)]
        out = [TokenLogprob(t, self._logprob(h, t), 0) for t in cands]
        out.sort(key=lambda c: -c.logprob)
        for rank, c in enumerate(out):
            c.rank = rank + 1
        return out

    # -- execution ------------------------------------------------------------------------

    def execute(self, step: StepInput) -> StepResult:
        self.num_steps += 1
        # In process, the engine puts a step's masks in it (`LLMEngine.attach_masks`).
        assert not step.deferred_mask_seq_ids, "an in-process step arrived with deferred masks"
        masks = {(m.seq_id, m.row): m for m in step.token_masks}
        self.num_masked_rows += len(masks)
        self.num_masked_draft_rows += sum(m.row > 0 for m in step.token_masks)
        drafts: dict[int, int] = {}  # seq id -> how many draft tokens it computes
        own: dict[int, int] = {}  # seq id -> passes after the first (multi-step decoding)
        imported, failed = self._transfer(step)
        for seq_id in step.freed_seq_ids:
            del self.seqs[seq_id]
        for fork in step.forks:
            p = self.seqs[fork.parent_seq_id]
            self.seqs[fork.child_seq_id] = _SeqState(
                p.request_id,
                fork.child_seq_index,
                list(p.tokens),
                p.num_prompt_tokens,
                p.num_computed,
                list(p.table),
                p.params,
                [list(t) for t in p.group_tables],
                state_slot=fork.child_state_slot,
            )
            if p.state_slot is not None:
                assert fork.child_state_slot is not None, "a fork without a state slot"
                self.state_slots[fork.child_state_slot] = self.state_slots[p.state_slot]
        self._swap_states(step)  # after the forks' copies, before the prefix hits'
        for new in step.new_seqs:
            assert new.seq_id not in self.seqs, f"new sequence {new.seq_id} already known"
            self.seqs[new.seq_id] = _SeqState(
                new.request_id,
                new.seq_index,
                list(new.token_ids),
                new.num_prompt_tokens,
                new.num_computed_tokens,
                list(new.block_ids),
                new.sampling_params,
                [list(t) for t in new.group_block_ids],
                state_slot=new.state_slot,
            )
            assert len(new.group_block_ids) == len(self.windows) - 1, "a table per KV group"
            assert (new.state_slot is None) == (not self.state_slots), "a state slot iff states"
            if new.state_slot is not None:
                source = new.state_from_slot
                assert (source is None) == (new.num_computed_tokens == 0), "a hit's snapshot"
                if source is not None:
                    self.state_slots[new.state_slot] = self.state_slots[source]
        skipped: set[int] = set()
        for upd in step.cached_seqs:
            st = self.seqs[upd.seq_id]
            if upd.after_drafts:
                assert upd.new_token_ids == [SAMPLED_TOKEN], "after drafts: the placeholder only"
                if st.drafts_cut:
                    self.num_skipped_after_drafts += 1
                    skipped.add(upd.seq_id)
                    st.table[upd.block_offset :] = upd.block_ids
                    self._edit_groups(st, upd.group_edits)
                    continue
                self.num_after_drafts += 1
            if SAMPLED_TOKEN in upd.new_token_ids:
                first, *rest = upd.new_token_ids
                assert first == SAMPLED_TOKEN and SAMPLED_TOKEN not in rest, "placeholder not first"
                assert st.last_sampled is not None, f"seq {upd.seq_id} sampled nothing"
                st.tokens += [st.last_sampled, *rest]
                self.num_placeholders += 1
                self.num_placeholder_runs += bool(rest)
            else:
                st.tokens.extend(upd.new_token_ids)
            if upd.draft_token_ids:  # computed after the known tokens, settled below
                assert upd.num_scheduled_tokens == 1 + len(upd.draft_token_ids)
                assert st.num_computed + 1 == len(st.tokens), "drafts after a prefill chunk"
                if upd.draft_token_ids == [SAMPLED_TOKEN] * len(upd.draft_token_ids):
                    own[upd.seq_id] = len(upd.draft_token_ids)  # multi-step: passes below
                else:
                    assert SAMPLED_TOKEN not in upd.draft_token_ids, "placeholder drafts mixed"
                    st.tokens.extend(upd.draft_token_ids)
                    drafts[upd.seq_id] = len(upd.draft_token_ids)
            assert upd.block_offset <= len(st.table)
            st.table[upd.block_offset :] = upd.block_ids
            self._edit_groups(st, upd.group_edits)
        for src, dst in step.blocks_to_swap_out:
            self.cpu[dst] = list(self.gpu[src])
        for src, dst in step.blocks_to_swap_in:
            self.gpu[dst] = list(self.cpu[src])
        for src, dst in step.blocks_to_copy:
            self.gpu[dst] = list(self.gpu[src])

        scheduled = [(n.seq_id, n.num_scheduled_tokens) for n in step.new_seqs] + [
            (c.seq_id, c.num_scheduled_tokens - own.get(c.seq_id, 0))
            for c in step.cached_seqs
            if c.seq_id not in skipped
        ]
        # Write every scheduled token's "K/V" first, as a batched forward pass would. A
        # sequence verifying drafts keeps its state from before them, to settle it after.
        before: dict[int, tuple[int, int]] = {}  # seq id -> (num computed, state) before
        for seq_id, num in scheduled:
            st = self.seqs[seq_id]
            if seq_id in drafts and st.state_slot is not None:
                before[seq_id] = (st.num_computed, self.state_slots[st.state_slot])
            self._write(st, num)
        for src, dst in step.state_saves:
            self.state_slots[dst] = self.state_slots[src]
        outputs = []
        for seq_id, num in scheduled:
            st = self.seqs[seq_id]
            start = st.num_computed
            st.num_computed += num
            assert st.num_computed <= len(st.tokens)
            if seq_id in drafts:
                n = drafts[seq_id]
                row_masks = [masks.pop((seq_id, row), None) for row in range(n + 1)]
                run = self._verify(seq_id, st, n, row_masks, before.get(seq_id))
                st.last_sampled = run[-1].samples[0].token_id
                st.drafts_cut = len(run) <= drafts[seq_id]
                outputs.extend(run)
                continue
            out = self._outputs(seq_id, st, start, masks.pop((seq_id, 0), None))
            if seq_id in own:
                st.drafts_cut = False
            for _ in range(own.get(seq_id, 0)):  # each a pass of its own, after the step's
                assert out is not None and len(out.samples) == 1, "multi-step without a sample"
                if self.passes_end is not None and self.passes_end():
                    st.drafts_cut = True  # as if the drafts left were rejected
                    self.num_runs_ended += 1
                    break
                outputs.append(out)
                st.tokens.append(out.samples[0].token_id)
                self._write(st, 1)
                st.num_computed += 1
                out = self._outputs(seq_id, st, st.num_computed - 1)
                self.num_own_steps += 1
            samples = [] if out is None else out.samples
            st.last_sampled = samples[0].token_id if len(samples) == 1 else None
            if out is not None:
                outputs.append(out)
        assert not masks, f"token masks for sequences that do not sample: {sorted(masks)}"
        return StepResult(
            step.step_id, outputs, imported_transfer_ids=imported, failed_imports=failed
        )

    def _write(self, st: _SeqState, num: int) -> None:
        """The "K/V" of the sequence's next `num` tokens, through each group's table, and its
        recurrent state (a hash of the tokens it computed)."""
        bs = self.block_size
        for table in (st.table, *st.group_tables):
            for pos in range(st.num_computed, st.num_computed + num):
                block_id = table[pos // bs]
                assert block_id != NULL_BLOCK or self.windows == (None,), "wrote the null block"
                self.gpu[block_id][pos % bs] = st.tokens[pos]
        if st.state_slot is not None:
            before = (st.num_computed, self.state_slots[st.state_slot])
            self.state_slots[st.state_slot] = self._state_after(st, before, st.num_computed + num)
        self.num_computed_tokens += num

    def _swap_states(self, step: StepInput) -> None:
        """Swapped sequences' states, after the forks' copies and before the prefix hits':
        out, then in (to the slot the scheduler gives the sequence now)."""
        by_slot = {st.state_slot: st for st in self.seqs.values() if st.state_slot is not None}
        for device, host in step.states_to_swap_out:
            self.host_state_slots[host] = self.state_slots[device]
            by_slot.pop(device).state_slot = -1 - host  # on the host
        by_host = {-1 - st.state_slot: st for st in by_slot.values() if st.state_slot < 0}
        for host, device in step.states_to_swap_in:
            self.state_slots[device] = self.host_state_slots[host]
            by_host.pop(host).state_slot = device

    def _edit_groups(self, st: _SeqState, edits: list[TableEdit]) -> None:
        assert len(edits) == len(self.windows) - 1, "an edit per KV group"
        for table, edit in zip(st.group_tables, edits, strict=True):
            assert edit.offset <= len(table)
            table[edit.offset :] = edit.block_ids

    def _transfer(self, step: StepInput) -> tuple[list[int], list[TransferFailure]]:
        """Releases, exports, then imports, in the contract's order."""
        for transfer_id in step.released_transfer_ids:
            del self.exports[transfer_id]
        for export in step.exports:
            assert export.transfer_id not in self.exports, "export registered twice"
            self.exports[export.transfer_id] = list(export.block_ids)
        imported: list[int] = []
        failed: list[TransferFailure] = []
        for item in step.imports:
            peer = self.peers.get(item.peer)
            source = None if peer is None else peer.exports.get(item.transfer_id)
            if self.fail_imports or peer is None or source is None:
                failed.append(TransferFailure(item.transfer_id, "no such export"))
                continue
            assert len(source) == len(item.block_ids), "import and export differ in length"
            for src, dst in zip(source, item.block_ids, strict=True):
                self.gpu[dst] = list(peer.gpu[src])
            imported.append(item.transfer_id)
        self.num_imports += len(imported)
        return imported, failed

    def _verify(
        self,
        seq_id: int,
        st: _SeqState,
        num_drafts: int,
        masks: list[TokenMask | None],
        before: tuple[int, int] | None = None,
    ) -> list[SequenceOutput]:
        """Sample at the last known token and at each draft (from the context read back from
        the cache up to that position, under that row's mask; with a state slot, `before`
        (tokens computed, state) before the step, from the state after that position), keep
        drafts while they equal the samples. The state is left after the kept ones only: a
        dropped draft leaves no trace (as the worker puts the state back)."""
        first_draft = len(st.tokens) - num_drafts
        run = []
        for i in range(num_drafts + 1):
            h = self._context_hash(st, first_draft + i)
            if before is not None:
                h = _mix(h, self._state_after(st, before, first_draft + i))
            mask = masks[i]
            allowed = (
                None if mask is None else [t for t in mask.allowed_ids() if t < self.vocab_size]
            )
            sample = self._sample(h, st.seq_index, allowed)
            top = self._top(h, st.params.logprobs) if st.params.logprobs else []
            run.append(SequenceOutput(seq_id, [sample], top))
            if i == num_drafts or sample.token_id != st.tokens[first_draft + i]:
                break
        self.num_drafts_kept += len(run) - 1
        del st.tokens[first_draft + len(run) - 1 :]
        st.num_computed = len(st.tokens)
        if before is not None:
            assert st.state_slot is not None
            self.state_slots[st.state_slot] = self._state_after(st, before, st.num_computed)
        return run

    @staticmethod
    def _state_after(st: _SeqState, before: tuple[int, int], length: int) -> int:
        """A state slot after the sequence's first `length` tokens, from (tokens computed,
        state) earlier."""
        computed, state = before
        return _mix_all(state if computed else 17, st.tokens[computed:length])

    def next_token(self, tokens: list[int], seq_index: int = 0) -> int:
        """What the model samples after `tokens` (unconstrained, not beam search): the
        oracle that test proposers draft from. As `_context_hash` reads the groups back,
        and with states, as a slot that computed every token holds it."""
        h = 17
        for window in self.windows:
            h = _mix_all(h, tokens[0 if window is None else max(0, len(tokens) - window) :])
        if self.state_slots:
            h = _mix(h, _mix_all(17, tokens))
        return self._sample(h, seq_index).token_id

    def _context_hash(self, st: _SeqState, length: int, windows: bool = True) -> int:
        """The context a query after `length` tokens reads back, group by group: a full
        group's every position, a windowed group's last `window` positions (`windows` False:
        only the full groups', for a prompt logprob that a worker takes from an earlier
        step's row, when the window still held it)."""
        bs = self.block_size
        h = 17
        for table, window in zip((st.table, *st.group_tables), self.windows, strict=True):
            if window is not None and not windows:
                continue
            first = 0 if window is None else max(0, length - window)
            for pos in range(first, length):
                slot = self.gpu[table[pos // bs]][pos % bs]
                h = _mix(h, -1 if slot is None else slot)
        return h

    def _outputs(
        self, seq_id: int, st: _SeqState, start: int, mask: TokenMask | None = None
    ) -> SequenceOutput | None:
        params = st.params
        prompt_lps: list[PromptLogprob] = []
        if params.prompt_logprobs is not None:
            for pos in range(max(start, 1), min(st.num_computed + 1, st.num_prompt_tokens)):
                h = self._context_hash(st, pos, windows=pos > start)
                tok = st.tokens[pos]
                prompt_lps.append(
                    PromptLogprob(
                        pos,
                        TokenLogprob(tok, self._logprob(h, tok), 0),
                        self._top(h, params.prompt_logprobs),
                    )
                )
        if st.num_computed < len(st.tokens):
            return SequenceOutput(seq_id, [], [], prompt_lps) if prompt_lps else None
        h = self._context_hash(st, len(st.tokens))
        if st.state_slot is not None:
            h = _mix(h, self.state_slots[st.state_slot])
        first = len(st.tokens) == st.num_prompt_tokens
        allowed = None
        if mask is not None:
            allowed = [t for t in mask.allowed_ids() if t < self.vocab_size]
            assert allowed, f"the mask of seq {seq_id} allows nothing"
        if params.use_beam_search:
            samples = self._beam_candidates(h, 2 * params.num_sampled, allowed)
        elif first and params.num_sampled > 1:
            samples = [self._sample(h, i, allowed) for i in range(params.num_sampled)]
        else:
            samples = [self._sample(h, st.seq_index, allowed)]
        top = self._top(h, params.logprobs) if params.logprobs else []
        return SequenceOutput(seq_id, samples, top, prompt_lps)
