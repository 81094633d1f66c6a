"""Ports picked for the stack's servers lie below the ephemeral range and are free (llmserve/ports.py)."""

import socket

import pytest

from llmserve.ports import LOWEST_PICKED_PORT, ephemeral_range, free_ports


def test_picked_ports_are_distinct_free_and_below_the_ephemeral_range():
    low, _ = ephemeral_range()
    if low <= LOWEST_PICKED_PORT + 16:
        # A kernel configured with a very low ephemeral range: free_ports then lets the OS
        # pick (the fallback), so there is no range below to check.
        pytest.skip("this kernel's ephemeral range leaves no room below it")
    ports = free_ports(16)
    assert len(set(ports)) == 16
    assert all(LOWEST_PICKED_PORT <= port < low for port in ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises when the port was not free


def test_a_listening_port_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", LOWEST_PICKED_PORT))
        held.listen()
        # A range of two ports below the ephemeral range, one of them taken.
        monkeypatch.setattr(
            "llmserve.ports.ephemeral_range", lambda: (LOWEST_PICKED_PORT + 2, 60999)
        )
        assert free_ports(1) == [LOWEST_PICKED_PORT + 1]


def test_the_range_file_is_read_and_a_missing_one_gives_linux_defaults(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("40000\t50000\n")
    assert ephemeral_range(str(path)) == (40000, 50000)
    assert ephemeral_range(str(tmp_path / "absent")) == (32768, 60999)
