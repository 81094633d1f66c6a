"""Ports for services started on loopback (the stack of `llmserve up`, tests, benchmarks):
picked free, and below the kernel's ephemeral range, so no outgoing connection takes one
between the pick and the service's bind."""

from __future__ import annotations

import random
import socket

LOOPBACK = "127.0.0.1"


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_PICKED_PORT = 10000  # below it lie the well-known services' registered ports


def ephemeral_range(path: str = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (and to binds on port 0)."""
    try:
        with open(path) as f:
            low, high = (int(part) for part in f.read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default range
    return low, high


def free_port(host: str = LOOPBACK) -> int:
    """A port that was free a moment ago."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` distinct ports that were free a moment ago, below the ephemeral range.

    A port the OS picks for a bind on port 0 comes from the ephemeral range, which is also
    where every outgoing connection gets its local port: between the pick and the server's
    bind, a connection (any process's) may take it. Ports below that range are only ever
    taken by an explicit bind. Each candidate is bound (and all are held until all are
    picked) to check it is free now; where the range leaves no room below it, the OS picks."""
    low, _ = ephemeral_range()
    candidates = list(range(LOWEST_PICKED_PORT, low))
    random.shuffle(candidates)
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            if len(sockets) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind((host, port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
