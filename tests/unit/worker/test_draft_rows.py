"""DraftRows (worker_service.linear_state): the decode rows of sequences with drafts, run in
waves; the states kept between waves, and the one put back after a rejected draft."""

from __future__ import annotations

import torch

from worker_service.linear_state import DraftRows

CPU = torch.device("cpu")


def test_rows_of_one_token_each_need_no_waves() -> None:
    assert DraftRows.build([(3, 0), (5, 0)], CPU) is None


def test_each_wave_takes_one_row_of_every_sequence_that_has_one() -> None:
    # Slot 7: a known token and two drafts; slot 2: a plain decode; slot 4: one draft.
    rows = DraftRows.build([(7, 0), (7, 1), (7, 2), (2, 0), (4, 0), (4, 1)], CPU)
    assert rows is not None
    assert [w.tolist() for w in rows.waves] == [[0, 3, 4], [1, 5], [2]]
    # After wave 0, slots 7 and 4 go on; after wave 1, slot 7 alone.
    assert rows.kept_slots == [[7, 4], [7]]


def test_restore_puts_back_the_state_after_the_last_kept_token() -> None:
    rows = DraftRows.build([(1, 0), (1, 1), (1, 2), (0, 0), (0, 1)], CPU)
    assert rows is not None
    conv, recurrent = torch.zeros(3, 2), torch.zeros(3, 2, 2)
    for wave in range(len(rows.waves)):  # each wave writes its number into the slots
        conv[:2], recurrent[:2] = wave + 1.0, -(wave + 1.0)
        rows.keep(layer=5, wave=wave, conv=conv, recurrent=recurrent)
    rows.restore(slot=1, kept=1)  # slot 1 kept one of its two drafts: the state after wave 1
    assert conv[1].eq(2.0).all() and recurrent[1].eq(-2.0).all()
    rows.restore(slot=0, kept=0)  # slot 0 kept none: the state after wave 0
    assert conv[0].eq(1.0).all() and recurrent[0].eq(-1.0).all()
    assert conv[2].eq(0.0).all()  # a slot of no row is untouched
