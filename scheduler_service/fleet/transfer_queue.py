"""The KV transfer maps a replica's next step carries (llmserve.steps: Transfers), and what its
worker reported of them.

The migration coordinator (`scheduler_service.fleet.kv_mover`) queues releases, exports and
imports here; the replica's step pipeline moves them into whichever step it sends next (an
otherwise empty step is sent for them) and hands each finished step's transfer news back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from llmserve.steps import BlockExport, BlockImport, StepInput, StepResult, TransferFailure


@dataclass(slots=True)
class TransferNews:
    """What one finished step says about transfers: its exports are now readable by peers, its
    imports are done or failed."""

    exported: list[int] = field(default_factory=list)
    imported: list[int] = field(default_factory=list)
    failed: list[TransferFailure] = field(default_factory=list)


class TransferQueue:
    """Transfer maps waiting for the replica's next step, and the exports its worker holds."""

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.releases: list[int] = []
        self.exports: list[BlockExport] = []
        self.imports: list[BlockImport] = []
        # Exports sent (or queued) and not yet released: the worker's stream must stay open
        # while a peer may read them.
        self.held: set[int] = set()

    def __bool__(self) -> bool:
        """Whether the next step has maps to carry."""
        return bool(self.releases or self.exports or self.imports)

    @property
    def busy(self) -> bool:
        """Whether the replica must keep stepping (or its stream open) for transfers."""
        return bool(self) or bool(self.held)

    def export(self, transfer_id: int, block_ids: list[int], state_slot: int | None = None) -> None:
        self.exports.append(BlockExport(transfer_id, list(block_ids), state_slot))
        self.held.add(transfer_id)
        self._wake()

    def release(self, transfer_id: int) -> None:
        """Forget an export: dropped before it was sent, else released by the next step."""
        if transfer_id not in self.held:
            return
        self.held.discard(transfer_id)
        queued = [e for e in self.exports if e.transfer_id != transfer_id]
        if len(queued) < len(self.exports):
            self.exports = queued
            return
        self.releases.append(transfer_id)
        self._wake()

    def import_blocks(
        self, transfer_id: int, peer: str, block_ids: list[int], state_slot: int | None = None
    ) -> None:
        self.imports.append(BlockImport(transfer_id, peer, list(block_ids), state_slot))
        self._wake()

    def cancel_import(self, transfer_id: int) -> bool:
        """Drop an import not yet sent. False if it was sent (its step will report it)."""
        kept = [i for i in self.imports if i.transfer_id != transfer_id]
        dropped = len(kept) < len(self.imports)
        self.imports = kept
        return dropped

    def attach(self, step: StepInput) -> None:
        """Move the queued maps into `step`."""
        if not self:
            return
        step.released_transfer_ids, self.releases = self.releases, []
        step.exports, self.exports = self.exports, []
        step.imports, self.imports = self.imports, []


def transfer_news(step: StepInput, result: StepResult | None) -> TransferNews | None:
    """The transfer news of a finished step; None when it carried no export or import."""
    if not (step.exports or step.imports):
        return None
    news = TransferNews(exported=[e.transfer_id for e in step.exports])
    if result is not None:
        news.imported = list(result.imported_transfer_ids)
        news.failed = list(result.failed_imports)
    return news
