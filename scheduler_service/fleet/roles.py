"""Worker roles in disaggregated serving (worker.proto's WorkerRole, `llmserve worker --role`).

Prefill workers prefill long prompts, streaming each prompt's KV blocks to a decode worker as
they are computed; once a request's first token is sampled, it moves there and decodes there
(`move_policy.hand_off`).
Decode workers take those moves, and prefill short prompts themselves: a prompt whose part not
already cached on the decode side is shorter than `prefill_local_below` tokens costs a decode
worker about a step, less than a hand-off's copy and its wait. Mixed workers do both. With no
prefill worker ready, or no decode or mixed one, every worker takes everything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from llmserve.proto_convert import ROLE_NAMES
from llmserve.v1 import worker_pb2
from scheduler_service.fleet.placement import Decision

if TYPE_CHECKING:
    from scheduler_service.fleet.replica import Replica

PREFILL = worker_pb2.WORKER_ROLE_PREFILL
Route = Callable[[list["Replica"], list[int]], "tuple[Replica, Decision] | None"]


def role(replica: Replica) -> int:
    """The replica's worker_pb2.WorkerRole (unspecified, which reads as mixed, until its
    worker has answered Info)."""
    return worker_pb2.WORKER_ROLE_UNSPECIFIED if replica.info is None else replica.info.role


def role_name(replica: Replica) -> str:
    """The role as `llmserve worker --role` names it: mixed, prefill or decode."""
    return ROLE_NAMES[role(replica)]


def choose(
    ready: list[Replica], prompt: list[int], local_below: int | None, route: Route
) -> tuple[Replica, Decision] | None:
    """Route `prompt` among `ready` replicas by role: to a decode (or mixed) replica, or, when
    placing a request (`local_below` set) whose uncached part there is `local_below` tokens or
    more, to a prefill replica."""
    prefill = [r for r in ready if role(r) == PREFILL]
    decode = [r for r in ready if role(r) != PREFILL]
    picked = route(decode or ready, prompt)
    if local_below is None or not (prefill and decode) or picked is None:
        return picked
    if len(prompt) - picked[1].cached_tokens < local_below:
        return picked
    return route(prefill, prompt)
