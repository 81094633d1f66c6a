"""The fault campaign's rounds and their checks (the stack, workload and faults are in
tests/support/campaign.py; what must hold is the docstring of
tests/integration/test_fault_campaign.py)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from tests.support.campaign import (
    REFUSALS,
    CampaignStack,
    Fault,
    Round,
    campaign_workload,
    draw_faults,
    run_round,
)
from tests.support.fleet import Received


@dataclass
class Report:
    """What a campaign did and found; `failures` is empty when every check held."""

    seed: int
    rounds: int = 0
    faults: dict[str, int] = field(default_factory=dict)
    requests_checked: int = 0
    differing: int = 0
    cancelled: int = 0
    retried: int = 0
    resent_after_refusal: int = 0  # workload requests refused under overload, then served
    # The codes clients of a killed gateway saw, with how many times each.
    lost_codes: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    bursts_served: int = 0
    # Per fault kind: for each stream mid-flight when it fired, the seconds from its last
    # response before the fault to its first one after.
    pauses: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


def run_campaign(
    stack: CampaignStack,
    seed: int,
    *,
    rounds: int | None = None,
    until: float | None = None,
    faults_per_round: int = 4,
    validate: Callable[[dict[str, Any], Received], str | None] = lambda spec, got: None,
    fixed_faults: list[Fault] | None = None,
) -> Report:
    """Rounds of (undisturbed reference, faulted run) until `rounds` are done or the clock
    passes `until` (time.monotonic()). `validate(spec, received)` names what is wrong with a
    constrained output, or returns None. `fixed_faults`: every round's faults, in place of
    drawn ones."""
    rng = random.Random(seed)
    report = Report(seed)
    while (rounds is None or report.rounds < rounds) and (
        until is None or time.monotonic() < until
    ):
        workload = campaign_workload(rng.randrange(1 << 30))
        undisturbed = [(rid, {k: v for k, v in spec.items() if k != "cancel_after"})
                       for rid, spec in workload]  # fmt: skip
        reference = run_round(stack, undisturbed, [])
        responses = reference.responses
        faults = draw_faults(rng, faults_per_round, responses)
        faulted = run_round(stack, workload, faults if fixed_faults is None else fixed_faults)
        for fault, _ in faulted.fired:
            report.faults[fault.kind] = report.faults.get(fault.kind, 0) + 1
        check_round(report, workload, reference, faulted, validate)
        try:
            wait_settled(stack)
            check_no_leak(stack)
        except AssertionError as exc:
            report.failures.append(f"round {report.rounds}: {exc}")
        report.rounds += 1
        if report.failures:
            break
    return report


def check_round(
    report: Report,
    workload: list[tuple[str, dict[str, Any]]],
    reference: Round,
    faulted: Round,
    validate: Callable[[dict[str, Any], Received], str | None],
) -> None:
    fail = report.failures.append
    for request_id, spec in workload:
        want, got = reference.outcomes[request_id], faulted.outcomes[request_id]
        report.requests_checked += 1
        report.retried += got.retries
        report.resent_after_refusal += got.refusals
        for code in got.lost_codes:
            report.lost_codes[code.name] = report.lost_codes.get(code.name, 0) + 1
        if want.error is not None or got.error is not None:
            fail(
                f"{request_id}: errors {want.error} {want.error_details!r} (undisturbed), "
                f"{got.error} {got.error_details!r} (faults)"
            )
            continue
        if got.cancelled:
            report.cancelled += 1
            if any(ids != want.received.token_ids[i][: len(ids)]
                   for i, ids in got.received.token_ids.items()):  # fmt: skip
                report.differing += 1
                fail(f"{request_id}: a cancelled stream is not a prefix of the undisturbed one")
            continue
        if difference := _difference(want.received, got.received):
            report.differing += 1
            fail(f"{request_id}: {difference}")
        if "grammar" in spec and (problem := validate(spec, got.received)):
            fail(f"{request_id}: invalid constrained output: {problem}")
    for request_id, got in faulted.bursts.items():
        if got.error is not None:
            report.refused += 1
            if got.error not in REFUSALS or got.received.num_tokens:
                fail(
                    f"{request_id}: refused with {got.error} after {got.received.num_tokens} tokens"
                )
        else:
            report.bursts_served += 1
            if got.received.completion_tokens != 4 or not got.received.finish_reasons:
                fail(f"{request_id}: a served burst request ended early: {got.received}")
    for fault, at in faulted.fired:
        pauses = report.pauses.setdefault(fault.kind, [])
        for outcome in faulted.outcomes.values():
            before = [t for t in outcome.times if t <= at]
            after = [t for t in outcome.times if t > at]
            if before and after:
                pauses.append(after[0] - before[-1])


def _difference(want: Received, got: Received) -> str | None:
    if got.token_ids != want.token_ids:
        return f"tokens {got.token_ids} != undisturbed {want.token_ids}"
    if got.finish_reasons != want.finish_reasons or got.completion_tokens != want.completion_tokens:
        return f"finish {got.finish_reasons}/{got.completion_tokens} != {want.finish_reasons}"
    for index, logprobs in want.logprobs.items():
        if any(abs(a - b) >= 1e-3 for a, b in zip(got.logprobs[index], logprobs, strict=True)):
            return f"logprobs of choice {index} differ"
    return None


def check_no_leak(stack: CampaignStack) -> None:
    """On every shard: each ready replica's blocks, slots and transfers free, invariants
    holding."""
    fleet = stack.fleet
    for shard in fleet.schedulers:
        stats = fleet.stats(shard)
        for replica in stats.replicas:
            assert not replica.invariant_violation, replica
        for r in fleet.ready_replicas(stats):
            free = (r.gpu_blocks_free == r.gpu_blocks_total and r.cpu_blocks_free == r.cpu_blocks_total
                    and r.state_slots_free == r.state_slots_total and r.num_transfers == 0)  # fmt: skip
            assert free, f"{shard.name}: {r}"


def wait_settled(stack: CampaignStack, timeout_s: float = 120.0) -> None:
    """Every process alive and healthy, each worker ready on some shard, and no request
    unfinished anywhere."""
    fleet = stack.fleet
    live = {w.address for w in fleet.workers if id(w) not in stack.retired}
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            stats = [fleet.stats(s) for s in fleet.schedulers]
            ready = {r.address for s in stats for r in fleet.ready_replicas(s)}
            if ready == live and all(s.num_unfinished_requests == 0 for s in stats):
                return
            last = (ready, live, [s.num_unfinished_requests for s in stats])
        except grpc.RpcError as exc:
            last = exc
        time.sleep(0.25)
    raise AssertionError(f"the stack did not settle: {last}")
