"""The fleet's background loops: lapsed leases, pending requests past their deadline, drained
workers that went away, and DNS discovery (see `scheduler_service.fleet.membership`). The
fleet starts them on its `Membership`, and hands in what else they do."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from llmserve.logs import get_logger
from scheduler_service.fleet.discovery import answers_health, resolve_workers
from scheduler_service.fleet.membership import DNS, STATIC, Membership

log = get_logger(__name__)


async def housekeeping(membership: Membership, expire_pending: Callable[[float], None]) -> None:
    """Once a second: lapsed leases, pending requests past their deadline (`expire_pending`,
    given the time), static workers another shard held that may be tried again, and (every
    5 s) drained workers gone."""
    probe_turn = 0
    while True:
        await asyncio.sleep(1.0)
        now = time.monotonic()
        membership.lapse_leases(now)
        expire_pending(now)
        for address in [a for a in membership.held.since if a in membership.static]:
            if membership.held.may_try(address, now):
                membership.add(address, STATIC)
        probe_turn += 1
        if membership.drained and probe_turn % 5 == 0:
            await _forget_gone_drained(membership)


async def _forget_gone_drained(membership: Membership) -> None:
    for address in list(membership.drained):
        if not await answers_health(address):
            log.info("drained worker is gone; its address may join again", address=address)
            del membership.drained[address]
            if address in membership.static:
                membership.add(address, STATIC)


async def watch_dns(membership: Membership) -> None:
    """Every `dns_interval_s`: addresses the names resolve to join (unless drained, or held
    by another shard lately); members they no longer resolve to lose the DNS source."""
    config = membership.config
    names = [n.strip() for n in config.worker_dns.split(",") if n.strip()]
    while True:
        found: set[str] = set()
        for name in names:
            found |= await resolve_workers(name)
        now = time.monotonic()
        for address in sorted(found - membership.drained.keys()):
            member = membership.members.get(address)
            joins = member is None or DNS not in member.sources
            if joins and membership.held.may_try(address, now):
                membership.add(address, DNS)
        for address, member in list(membership.members.items()):
            if DNS in member.sources and address not in found:
                membership.drop_source(address, DNS, "dns")
        await asyncio.sleep(config.dns_interval_s)
