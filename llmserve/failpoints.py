"""Failpoints: faults injected at named places in the code, for tests of failure handling.

`LLMSERVE_FAILPOINTS` holds `;`-separated entries `NAME[@MATCH][=COUNT[+SKIP]]`.
`check(NAME, subject)` raises `InjectedFault` where an entry names NAME, MATCH is empty or a
substring of `subject` (e.g. a worker address), the entry has already let SKIP matching checks
pass (default 0), and it has fired fewer than COUNT times (default 1). Unset, `check` is one
dictionary lookup. Places: `replica.finish_step` (subject: worker address),
between a step's result and its output processing. `crash(NAME)` ends the process with SIGKILL
instead of raising, for tests of a process dying mid-operation: `worker.read_blocks` (subject:
transfer id), a worker serving a KV export after its header; `worker.import_blocks` (subject:
the peer's address), a worker importing KV blocks after the export's header arrived.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass


class InjectedFault(RuntimeError):
    """Raised by a failpoint."""


@dataclass(slots=True)
class _Entry:
    match: str
    remaining: int
    skip: int


def _parse(spec: str) -> dict[str, list[_Entry]]:
    entries: dict[str, list[_Entry]] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name_match, _, count_skip = item.partition("=")
        name, _, match = name_match.partition("@")
        count, _, skip = count_skip.partition("+")
        entries.setdefault(name, []).append(
            _Entry(match, int(count) if count else 1, int(skip) if skip else 0)
        )
    return entries


_ENTRIES = _parse(os.environ.get("LLMSERVE_FAILPOINTS", ""))


def check(name: str, subject: str = "") -> None:
    """Raise InjectedFault if an armed failpoint NAME matches `subject`."""
    entries = _ENTRIES.get(name)
    if not entries:
        return
    for entry in entries:
        if entry.remaining > 0 and entry.match in subject:
            if entry.skip > 0:
                entry.skip -= 1
                continue
            entry.remaining -= 1
            raise InjectedFault(f"failpoint {name} fired for {subject!r}")


def crash(name: str, subject: str = "") -> None:
    """SIGKILL this process if an armed failpoint NAME matches `subject` (see `check`)."""
    try:
        check(name, subject)
    except InjectedFault:
        os.kill(os.getpid(), signal.SIGKILL)
