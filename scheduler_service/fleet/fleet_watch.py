"""The fleet's background loops: lapsed leases, pending requests past their deadline, drained
workers that went away, and DNS discovery (see `scheduler_service.fleet.fleet`, Membership)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from llmserve.errors import UnavailableError
from llmserve.logs import get_logger
from scheduler_service.fleet.discovery import answers_health, resolve_workers
from scheduler_service.fleet.tracing import end_request_trace

if TYPE_CHECKING:
    from scheduler_service.fleet.fleet import Fleet

log = get_logger(__name__)

# The sources that make a worker a replica.
STATIC, DNS, LEASE = "static", "dns", "lease"


async def housekeeping(fleet: Fleet) -> None:
    """Once a second: lapsed leases, pending requests past their deadline, static workers
    another shard held that may be tried again, and (every 5 s) drained workers gone."""
    probe_turn = 0
    while True:
        await asyncio.sleep(1.0)
        now = time.monotonic()
        for address, expiry in list(fleet.leases.items()):
            if expiry < now:
                del fleet.leases[address]
                fleet.drop_source(address, LEASE, "lease")
        expire_pending(fleet, now)
        for address in [a for a in fleet.held.since if a in fleet.static]:
            if fleet.held.may_try(address, now):
                fleet.add(address, STATIC)
        probe_turn += 1
        if fleet.drained and probe_turn % 5 == 0:
            await _forget_gone_drained(fleet)


def expire_pending(fleet: Fleet, now: float) -> None:
    """Fail the requests that have waited for a ready replica past their deadline."""
    for key, pending in list(fleet.pending.items()):
        if pending.deadline <= now:
            del fleet.pending[key]
            message = (
                f"no worker became available within {fleet.config.no_worker_timeout_s:g} s "
                f"({len(fleet.members)} known, none ready)"
            )
            end_request_trace(pending.trace, message)
            fleet.owner.fail_request(key, UnavailableError(message))


async def _forget_gone_drained(fleet: Fleet) -> None:
    for address in list(fleet.drained):
        if not await answers_health(address):
            log.info("drained worker is gone; its address may join again", address=address)
            del fleet.drained[address]
            if address in fleet.static:
                fleet.add(address, STATIC)


async def watch_dns(fleet: Fleet) -> None:
    """Every `dns_interval_s`: addresses the names resolve to join (unless drained, or held
    by another shard lately); members they no longer resolve to lose the DNS source."""
    names = [n.strip() for n in fleet.config.worker_dns.split(",") if n.strip()]
    while True:
        found: set[str] = set()
        for name in names:
            found |= await resolve_workers(name)
        now = time.monotonic()
        for address in sorted(found - fleet.drained.keys()):
            member = fleet.members.get(address)
            if (member is None or DNS not in member.sources) and fleet.held.may_try(address, now):
                fleet.add(address, DNS)
        for address, member in list(fleet.members.items()):
            if DNS in member.sources and address not in found:
                fleet.drop_source(address, DNS, "dns")
        await asyncio.sleep(fleet.config.dns_interval_s)
