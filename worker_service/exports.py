"""What a worker exports to its peers (steps.py: Transfers), without torch: the servicer reads it
for ReadBlocks, and the simulated worker (tests/support) has one too."""

from __future__ import annotations

from llmserve.steps import StepInput


class Exports:
    """Transfer id -> the device blocks exported under it (and the state slot, for a model
    with recurrent layers). Written on the model thread as steps apply, read by ReadBlocks on
    the event loop (single dict operations)."""

    def __init__(self) -> None:
        self.blocks: dict[int, list[int]] = {}
        self.state_slots: dict[int, int] = {}

    def apply(self, step: StepInput) -> None:
        for transfer_id in step.released_transfer_ids:
            self.blocks.pop(transfer_id, None)
            self.state_slots.pop(transfer_id, None)
        for export in step.exports:
            if export.state_slot is not None:
                self.state_slots[export.transfer_id] = export.state_slot
            self.blocks[export.transfer_id] = list(export.block_ids)

    def clear(self) -> None:
        self.blocks.clear()
        self.state_slots.clear()
