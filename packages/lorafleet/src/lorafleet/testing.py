"""Helpers for tests that start real processes on loopback.

Used by the pytest fixtures in the root `conftest.py` and by `lorafleet up`. Everything
started here is stopped by its own PID, never by name: these machines are shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from lorafleet.v1 import common_pb2, controller_pb2, trainer_pb2

T = TypeVar("T")

# How long a test waits for something that must happen. Generous on purpose: a test waits
# on the condition itself, never a fixed number of short polls, so a loaded CI machine
# (two busy loops beside the suite) makes a test slower, never red.
WAIT_SECONDS = 300.0
_POLL_SECONDS = 0.05


def _waited(what: str, started: float) -> None:
    """Report how long a wait took (pytest shows it with the test's output)."""
    print(f"waited {time.monotonic() - started:.2f}s for {what}", file=sys.stderr)


def wait_until(condition: Callable[[], T], what: str, within: float = WAIT_SECONDS) -> T:
    """Poll `condition()` until it returns something truthy and return that; raise
    AssertionError naming `what` after `within` seconds. The one way tests wait."""
    started = time.monotonic()
    deadline = started + within
    while True:
        value = condition()
        if value:
            _waited(what, started)
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:.0f}s: {what}")
        time.sleep(_POLL_SECONDS)


async def wait_until_async(
    condition: Callable[[], Awaitable[T] | T], what: str, within: float = WAIT_SECONDS
) -> T:
    """`wait_until` for asyncio tests: `condition` may be a coroutine function."""
    started = time.monotonic()
    deadline = started + within
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            _waited(what, started)
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:.0f}s: {what}")
        await asyncio.sleep(_POLL_SECONDS)


# Callers start processes in binary or text mode; waiting and stopping work on either.
Process = subprocess.Popen[bytes] | subprocess.Popen[str]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = WAIT_SECONDS, proc: Process | None = None) -> None:
    """Poll until something accepts connections on 127.0.0.1:port, or fail with its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout:.0f}s")


def _status_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak_rss(pid: int) -> int:
    """Reset a process's peak RSS (VmHWM, via /proc/<pid>/clear_refs) to what it holds now,
    and return that in bytes: `peak_rss(pid) - reset_peak_rss(pid)` is what happened between."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_bytes(pid, "VmRSS")


def peak_rss(pid: int) -> int:
    """A process's peak RSS in bytes since its last `reset_peak_rss`."""
    return _status_bytes(pid, "VmHWM")


def stop_process(proc: Process, grace: float = 10.0) -> int | None:
    """SIGTERM, wait up to `grace`, then SIGKILL. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


@dataclass
class RedisServer:
    """A private redis-server on a free loopback port."""

    port: int
    proc: subprocess.Popen[bytes]
    data_dir: Path
    password: str = ""  # requirepass ("": none)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop_process(self.proc, grace=5)


# The private servers' maxmemory: far above what a test or a local fleet stores, far below
# the machine's memory.
REDIS_MAXMEMORY = "2gb"


def redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not installed: apt-get install -y redis-server")
    return path


# How often a server started on ports chosen here is tried again on fresh ports: a port from
# free_port() is free a moment before the server binds it, and in that moment any outgoing
# connection on the machine may take it as its own local port (CI failed a cluster test on
# "bind: Address already in use"). Retrying is right only for that cause.
_PORT_ATTEMPTS = 5


class PortTaken(RuntimeError):
    """The server exited because one of the ports chosen for it was taken before it bound."""


def _redis_pid(port: int, password: str = "") -> int | None:
    """The PID of the redis-server answering on 127.0.0.1:port, or None when none answers
    yet (inline AUTH and INFO commands: no client library needed)."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as sock:
        sock.settimeout(5)
        auth = f"AUTH {password}\r\n".encode() if password else b""
        sock.sendall(auth + b"INFO server\r\n")
        reply = b""
        while b"process_id:" not in reply or not reply.endswith(b"\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        for line in reply.decode(errors="replace").splitlines():
            if line.startswith("process_id:"):
                return int(line.split(":", 1)[1])
    return None


def _wait_for_own_redis(port: int, proc: subprocess.Popen[bytes], password: str) -> None:
    """Until the server answering on `port` is `proc` itself: an open port alone may be
    another process's, which took it first (and `proc` is about to exit on EADDRINUSE)."""
    deadline = time.monotonic() + WAIT_SECONDS
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened")
        if _redis_pid(port, password) == proc.pid:
            return
        time.sleep(_POLL_SECONDS)
    raise TimeoutError(f"redis-server {proc.pid} not answering on 127.0.0.1:{port}")


def _launch_redis(
    data_dir: Path, port: int, appendonly: bool, extra: list[str], password: str
) -> RedisServer:
    args = [redis_server_binary()]
    if password:
        # From a file of the owner's, not the command line: argv is every local user's to read.
        conf = data_dir / "auth.conf"
        conf.unlink(missing_ok=True)
        with os.fdopen(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(f"requirepass {password}\n")
        args.append(str(conf))
    args += [
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--dir",
        str(data_dir),
        "--daemonize",
        "no",
        "--logfile",
        str(data_dir / "redis.log"),
    ]
    if appendonly:
        args += ["--appendonly", "yes", "--appendfsync", "always"]
    else:
        args += ["--appendonly", "no"]
    # As in the chart: bounded, and never evicting (an evicted key is a lost operation); the
    # controller refuses new work before the bound (store/room.py). `extra` may override.
    args += ["--maxmemory", REDIS_MAXMEMORY, "--maxmemory-policy", "noeviction"]
    args += extra
    # Own session: a Ctrl-C meant for `lorafleet up` must not kill Redis before the services.
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_for_own_redis(port, proc, password)
    except RuntimeError as exc:
        log = data_dir / "redis.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        if "Address already in use" in tail:
            raise PortTaken(f"{exc}: a port was taken by another process first") from exc
        raise RuntimeError(f"{exc}; redis.log ends:\n{tail}") from exc
    return RedisServer(port=port, proc=proc, data_dir=data_dir, password=password)


def start_redis(
    data_dir: Path,
    *,
    port: int | None = None,
    appendonly: bool = False,
    extra: list[str] | None = None,
    password: str = "",
) -> RedisServer:
    """Start redis-server in the foreground of a child process (so its PID is ours).

    With `appendonly`, every write is fsynced before it is acknowledged, for the
    durability-across-restart tests; `extra` adds server options; with `password` clients
    must AUTH (`url` carries it). A port chosen here that another process takes first is
    replaced by a fresh one; a port the caller gave is not.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    if port is not None:
        return _launch_redis(data_dir, port, appendonly, extra or [], password)
    for _ in range(_PORT_ATTEMPTS - 1):
        with contextlib.suppress(PortTaken):
            return _launch_redis(data_dir, free_port(), appendonly, extra or [], password)
    return _launch_redis(data_dir, free_port(), appendonly, extra or [], password)


@contextlib.contextmanager
def redis_server(
    data_dir: Path,
    *,
    port: int | None = None,
    appendonly: bool = False,
    extra: list[str] | None = None,
    password: str = "",
) -> Iterator[RedisServer]:
    server = start_redis(data_dir, port=port, appendonly=appendonly, extra=extra, password=password)
    try:
        yield server
    finally:
        server.stop()


@dataclass
class RedisClusterNodes:
    """A private Redis Cluster: `masters` redis-servers in cluster mode, slots spread evenly."""

    nodes: list[RedisServer]

    @property
    def url(self) -> str:
        """A seed node's URL; a cluster client discovers the others from it."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _start_cluster_node(folder: Path) -> RedisServer:
    """One cluster-enabled redis-server; its client and bus ports are both chosen afresh when
    either was taken first. The bus port is given: the default (port + 10000) overflows for
    the high ephemeral ports free_port() hands out."""

    def launch() -> RedisServer:
        (folder / "nodes.conf").unlink(missing_ok=True)
        extra = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(folder / "nodes.conf"),
            "--cluster-node-timeout",
            "5000",
            "--cluster-port",
            str(free_port()),
        ]
        return _launch_redis(folder, free_port(), False, extra, "")

    for _ in range(_PORT_ATTEMPTS - 1):
        with contextlib.suppress(PortTaken):
            return launch()
    return launch()


# A cluster of idle local nodes joins in well under a second; this bounds one attempt on a
# loaded machine. CI once spent its whole 600 s test timeout in this fixture with no trace.
_CLUSTER_JOIN_SECONDS = 120.0
_CLUSTER_ATTEMPTS = 3


def _join_cluster(cli: str, nodes: list[RedisServer], within: float) -> None:
    """`redis-cli --cluster create` (no replicas), then wait for `cluster_state:ok` on every
    node; TimeoutError (with each node's log tail) when that takes longer than `within`."""
    deadline = time.monotonic() + within
    addresses = [f"127.0.0.1:{n.port}" for n in nodes]
    try:
        subprocess.run(
            [cli, "--cluster", "create", *addresses, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            timeout=within,
        )
        for node in nodes:
            while True:
                info = subprocess.run(
                    [cli, "-p", str(node.port), "cluster", "info"],
                    capture_output=True,
                    text=True,
                    timeout=max(1.0, deadline - time.monotonic()),
                ).stdout
                if "cluster_state:ok" in info:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Redis Cluster node {node.port} never became ok")
                time.sleep(0.1)
    except subprocess.TimeoutExpired as exc:
        logs = "\n".join(
            f"--- node {n.port}:\n" + (n.data_dir / "redis.log").read_text(errors="replace")[-1500:]
            for n in nodes
        )
        raise TimeoutError(f"Redis Cluster did not join within {within:.0f}s\n{logs}") from exc


def start_redis_cluster(
    data_dir: Path, masters: int = 3, timeout: float = _CLUSTER_JOIN_SECONDS
) -> RedisClusterNodes:
    """Start `masters` cluster-enabled redis-servers and join them. A join that does not finish
    within `timeout` is reported on stderr with the nodes' logs and tried again on fresh nodes
    and ports (a startup race, bounded by _CLUSTER_ATTEMPTS); the last attempt's error is
    raised."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError("redis-cli is not installed: apt-get install -y redis-tools")
    for attempt in range(1, _CLUSTER_ATTEMPTS + 1):
        nodes: list[RedisServer] = []
        try:
            for i in range(masters):
                folder = data_dir / f"attempt-{attempt}" / f"node-{i}"
                folder.mkdir(parents=True)
                nodes.append(_start_cluster_node(folder))
            _join_cluster(cli, nodes, timeout)
            return RedisClusterNodes(nodes)
        except BaseException as exc:
            for node in nodes:
                node.stop()
            if not isinstance(exc, TimeoutError) or attempt == _CLUSTER_ATTEMPTS:
                raise
            print(f"Redis Cluster attempt {attempt} failed, trying again: {exc}", file=sys.stderr)
    raise AssertionError("the last attempt returns or raises")


@contextlib.contextmanager
def service_process(
    module: str, port: int, env: dict[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m module` with stdout and stderr in `log`, yielded once `port` accepts
    connections (the model may still be loading: see `wait_serving`); stopped by its PID."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", module], env=env, stdout=out, stderr=subprocess.STDOUT
        )
        try:
            wait_for_port(port, proc=proc)
            yield proc
        finally:
            stop_process(proc)


async def wait_serving(channel: object, service: str, within: float = WAIT_SECONDS) -> None:
    """Poll gRPC health for `service` on `channel` (a grpc.aio.Channel) until SERVING: the
    runtime reports NOT_SERVING until startup (model load) is done, though the port is open."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest(service=service)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.aio.AioRpcError):
            reply = await health.Check(request, timeout=5)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{service} never reported SERVING")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a service subprocess: offline, unbuffered, one torch thread pool."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def payload_bytes(inp: common_pb2.ForwardBackwardInput, *, forward: bool = False) -> bytes:
    """A forward_backward (or forward) OperationPayload serialised as the gateway writes it:
    what SubmitOperationRequest.payload and ForwardBackwardItem.payload carry."""
    payload = (
        controller_pb2.OperationPayload(forward=inp)
        if forward
        else controller_pb2.OperationPayload(forward_backward=inp)
    )
    return payload.SerializeToString(deterministic=True)


def fb_output(item: trainer_pb2.ForwardBackwardItemResult) -> common_pb2.ForwardBackwardOutput:
    """The output a trainer batch item result carries (serialised as an OperationResult);
    an item that failed fails the caller with its error."""
    if item.WhichOneof("outcome") != "result":
        raise AssertionError(f"{item.operation_id} failed: {item.error}")
    return controller_pb2.OperationResult.FromString(item.result).forward_backward


def op_result(op: controller_pb2.Operation) -> controller_pb2.OperationResult:
    """An operation's result, parsed from the bytes GetOperation returns."""
    return controller_pb2.OperationResult.FromString(op.result)
