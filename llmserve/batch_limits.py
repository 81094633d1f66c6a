"""Batch limits: the largest step a scheduler sends. The scheduler owns them; workers follow.

`max_num_seqs` sequences and `max_num_batched_tokens` tokens per step bound the scheduler's
budget, and they size what a worker prepares for its largest step: the profile run that
decides how many KV blocks fit beside it (CUDA), and the decode batch sizes it captures as
CUDA graphs. The scheduler takes them from its flags and sends them in every InitializeCache
(protos/llmserve/v1/worker.proto); the worker adopts them (`adopt_batch_limits`). Until then a
worker runs under its own flags of the same names, or the defaults: its start-up profile uses
them, and a worker that no scheduler initializes keeps them. A flag that is set pins its limit:
a scheduler that sends another value is refused by name, since one of the two was started
with a value the other would not use.

The defaults live here: the scheduler's flags take them (SchedulerConfig's fields), and so does
a worker whose flags are not set.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from llmserve.errors import FieldError

DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """The most sequences, and tokens, that one step holds."""

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 1:
                raise FieldError(f.name, f"must be at least 1, got {value}")


@dataclass(frozen=True, slots=True)
class GivenBatchLimits:
    """Batch limits as given, each None where it was not: a worker's flags, or the fields of
    an InitializeCacheRequest."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None

    def or_defaults(self) -> BatchLimits:
        """Each limit given, else its default."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return BatchLimits(**{name: value for name, value in given.items() if value is not None})


def flag(name: str) -> str:
    """`max_num_seqs` -> `--max-num-seqs`."""
    return "--" + name.replace("_", "-")


def adopt_batch_limits(own: GivenBatchLimits, sent: GivenBatchLimits) -> BatchLimits:
    """The limits a worker runs under: each what its scheduler `sent`, else the worker's
    `own` flag, else the default. Raises FieldError naming the limit, its flag and both
    values when the worker's flag sets it to another value than the scheduler sent."""
    chosen: dict[str, int | None] = {}
    for f in fields(GivenBatchLimits):
        mine, theirs = getattr(own, f.name), getattr(sent, f.name)
        if mine is not None and theirs is not None and mine != theirs:
            raise FieldError(
                f.name,
                f"the scheduler sends {theirs}, but this worker was started with "
                f"{flag(f.name)} {mine}; start the worker without {flag(f.name)} (it follows "
                "the scheduler) or give both the same value",
            )
        chosen[f.name] = theirs if theirs is not None else mine
    return GivenBatchLimits(**chosen).or_defaults()
