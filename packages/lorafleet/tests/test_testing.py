"""The test helpers' own guarantees: a Redis started on a port another process took first
moves to a fresh port (CI failed a Redis Cluster fixture on "bind: Address already in use"),
and a port the caller chose is never silently replaced."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import redis

from lorafleet import testing


def _occupied() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_port_taken_before_redis_binds_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _occupied() as taken:
        port = taken.getsockname()[1]
        handed = iter([port, port, testing.free_port()])
        # free_port() answers as in the race: the first two ports are taken by then
        monkeypatch.setattr(testing, "free_port", lambda: next(handed))
        server = testing.start_redis(tmp_path / "redis")
        try:
            assert server.port != port
            assert redis.Redis(port=server.port).ping()
        finally:
            server.stop()


def test_a_port_the_caller_chose_is_not_replaced(tmp_path: Path) -> None:
    with _occupied() as taken:
        port = taken.getsockname()[1]
        with pytest.raises(testing.PortTaken, match="taken by another process"):
            testing.start_redis(tmp_path / "redis", port=port)


def test_a_cluster_node_whose_bus_port_was_taken_starts_on_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _occupied() as taken:
        busy = taken.getsockname()[1]
        real = testing.free_port
        handed = iter([busy])  # the first node's bus port is taken; every other port is free
        monkeypatch.setattr(testing, "free_port", lambda: next(handed, None) or real())
        cluster = testing.start_redis_cluster(tmp_path / "cluster", masters=3)
        try:
            info = redis.Redis(port=cluster.nodes[0].port).cluster("info")
            assert info["cluster_state"] == "ok"
            assert busy not in [n.port for n in cluster.nodes]
        finally:
            cluster.stop()
