"""Discovery and leader election against recorded Kubernetes API responses.

A small HTTP server plays back the bodies in `recorded/` (and keeps one Lease with real
resourceVersion checks), so the real `kubernetes` client runs end to end: ApiClient, model
deserialization, `watch.Watch` stream parsing, ApiException on Status errors.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from lorafleet.errors import InvalidArgument, LorafleetError
from lorafleet.testing import WAIT_SECONDS, wait_until_async
from lorafleet.v1 import common_pb2
from lorafleet_controller.discovery import (
    Endpoint,
    KubernetesDiscovery,
    LeaderElector,
    StaticDiscovery,
    parse_static,
)
from lorafleet_controller.ledger import Ledger
from lorafleet_controller.notify import Notifier
from lorafleet_controller.registry import Registry, Replica
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import OpState, StaleEpoch, Store, connect

RECORDED = Path(__file__).parent / "recorded"
NS = "ml"
TRAINERS, ROLLOUTS = "rel-lorafleet-trainer-headless", "rel-lorafleet-rollout-headless"
SERVICES = {TRAINERS: "trainer", ROLLOUTS: "rollout"}
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"
LEASE = "rel-lorafleet-controller"


def recorded(name: str) -> bytes:
    return (RECORDED / name).read_bytes()


class FakeApiServer:
    """Serves recorded responses; holds one Lease with optimistic concurrency.

    `lists` and `watches` are queues of recorded files answered in order; `requests` keeps
    (method, path, query) of every request; `blocked` holds client ids (X-Client header)
    whose requests are held until the test unblocks them, i.e. a network partition.
    """

    def __init__(self) -> None:
        self.lists: list[str] = []
        self.watches: list[str] = []
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        self.lease: dict | None = None
        self.version = 51000
        self.blocked: set[str] = set()
        self.closing = threading.Event()
        self.lock = threading.Lock()
        self.lease_writes: list[tuple[str, str]] = []  # (client, holder) of accepted writes
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}")

            def _send(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _handle(self, method: str) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                server.requests.append((method, url.path, query))
                who = self.headers.get("X-Client", "")
                while who in server.blocked:
                    time.sleep(0.01)
                if url.path == SLICES and query.get("watch") == ["true"]:
                    self._stream(recorded(server.watches.pop(0)) if server.watches else None)
                elif url.path == SLICES:
                    self._send(200, recorded(server.lists.pop(0)))
                elif url.path.startswith(LEASES):
                    body = self._body() if method in ("POST", "PUT") else {}
                    self._send(*server.lease_request(method, url.path, body, who))
                else:
                    self._send(404, recorded("status-404-lease.json"))

            def _stream(self, lines: bytes | None) -> None:
                """A watch response: events one per line, then the server ends the watch.

                With nothing left to play, the watch stays open and idle, as a real one does.
                """
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self.wfile.flush()
                while lines is None and not server.closing.is_set():
                    server.closing.wait(0.05)
                for line in (lines or b"").splitlines(keepends=True):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def do_GET(self) -> None:
                self._handle("GET")

            def do_POST(self) -> None:
                self._handle("POST")

            def do_PUT(self) -> None:
                self._handle("PUT")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def lease_request(self, method: str, path: str, body: dict, who: str) -> tuple[int, bytes]:
        with self.lock:
            name = path.removeprefix(LEASES).strip("/") or body["metadata"]["name"]
            assert name == LEASE, name
            if method == "GET":
                if self.lease is None:
                    return 404, recorded("status-404-lease.json")
                return 200, json.dumps(self.lease).encode()
            if method == "POST":
                if self.lease is not None:
                    return 409, recorded("status-409-exists.json")
            elif self.lease is None:
                return 404, recorded("status-404-lease.json")
            elif (
                body["metadata"].get("resourceVersion") != self.lease["metadata"]["resourceVersion"]
            ):
                return 409, recorded("status-409-conflict.json")
            stored = json.loads(recorded("lease.json"))
            stored["spec"] = body["spec"]
            self.version += 1
            stored["metadata"]["resourceVersion"] = str(self.version)
            self.lease = stored
            self.lease_writes.append((who, body["spec"].get("holderIdentity")))
            return (201 if method == "POST" else 200), json.dumps(stored).encode()

    @property
    def host(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def api_client(self, who: str = "") -> client.ApiClient:
        config = client.Configuration(host=self.host)
        api = client.ApiClient(config)
        api.set_default_header("X-Client", who)
        return api

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.blocked.clear()
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def apiserver():
    with FakeApiServer() as server:
        yield server


async def wait_until(condition, within: float = WAIT_SECONDS) -> None:
    await wait_until_async(condition, "the condition", within)


def ep(kind: str, pod: str, address: str, ready: bool = True) -> Endpoint:
    return Endpoint(kind, f"rel-lorafleet-{pod}", address, ready)


LISTED = [
    ep("rollout", "rollout-0", "10.244.1.23:50053"),
    ep("rollout", "rollout-1", "10.244.3.5:50053", ready=False),  # terminating
    ep("rollout", "rollout-2", "10.244.3.6:50053"),  # no conditions: ready
    ep("trainer", "trainer-0", "10.244.1.17:50052"),
    ep("trainer", "trainer-1", "10.244.2.9:50052", ready=False),
]


# --- static -------------------------------------------------------------------------------


async def test_static_discovery_parses_the_controller_setting():
    endpoints = parse_static("trainer", ("t1=10.0.0.2:50052", "t0=host-a:50052"), field="trainers")
    discovery = StaticDiscovery(endpoints)
    expected = [Endpoint("trainer", "t0", "host-a:50052", True), endpoints[0]]
    assert await discovery.snapshot() == expected
    stream = discovery.watch()
    assert await anext(stream) == expected
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(anext(stream), 0.05)  # nothing changes, ever


@pytest.mark.parametrize(
    ("entries", "field"),
    [
        (("host:1",), "trainers[0]"),
        (("a=b:1", "c=nope"), "trainers[1]"),
        (("a=h:0",), "trainers[0]"),
        (("a=h:1", "a=h:2"), "trainers[1]"),
    ],
)
def test_static_discovery_rejects_bad_entries(entries, field):
    with pytest.raises(InvalidArgument) as info:
        parse_static("trainer", entries, field="trainers")
    assert info.value.field == field


# --- EndpointSlices -----------------------------------------------------------------------


async def test_snapshot_from_recorded_list(apiserver):
    apiserver.lists.append("endpointslices-list.json")
    discovery = KubernetesDiscovery(apiserver.api_client(), NS, SERVICES)
    assert await discovery.snapshot() == LISTED
    ((method, path, query),) = apiserver.requests
    assert (method, path) == ("GET", SLICES)
    assert query["labelSelector"] == [f"kubernetes.io/service-name in ({ROLLOUTS},{TRAINERS})"]


async def test_watch_follows_recorded_events(apiserver):
    apiserver.lists.append("endpointslices-list.json")
    apiserver.watches += ["endpointslices-watch.jsonl", "endpointslices-watch-gone.jsonl"]
    apiserver.lists.append("endpointslices-list-relist.json")
    discovery = KubernetesDiscovery(apiserver.api_client(), NS, SERVICES, watch_timeout_seconds=5)
    stream = discovery.watch()
    seen = [await asyncio.wait_for(anext(stream), 10) for _ in range(5)]
    # The first watch ended; the next resumes from the last version, gets 410, relists
    # (same endpoints: nothing to yield) and then idles.
    pending = asyncio.ensure_future(anext(stream))
    await wait_until(lambda: len(apiserver.requests) >= 5)
    pending.cancel()
    await asyncio.gather(pending, return_exceptions=True)
    await stream.aclose()

    trainer_1_ready = [*LISTED[:4], ep("trainer", "trainer-1", "10.244.2.9:50052")]
    assert seen[0] == LISTED
    assert seen[1] == trainer_1_ready  # MODIFIED: trainer-1 became ready
    with_3 = sorted([*trainer_1_ready, ep("rollout", "rollout-3", "10.244.4.2:50053")])
    assert seen[2] == with_3  # ADDED: a second slice; the BOOKMARK before it changed nothing
    without_1 = [e for e in with_3 if e.replica_id != "rel-lorafleet-rollout-1"]
    assert seen[3] == without_1  # MODIFIED: rollout-1 gone; the next MODIFIED changed nothing
    assert seen[4] == [e for e in without_1 if e.replica_id != "rel-lorafleet-rollout-3"]

    watches = [q for m, p, q in apiserver.requests if q.get("watch") == ["true"]]
    assert watches[0]["resourceVersion"] == ["48211"]  # from the list
    assert watches[0]["allowWatchBookmarks"] == ["true"]
    assert watches[1]["resourceVersion"] == ["48281"]  # resumed after the last event
    assert watches[2]["resourceVersion"] == ["48950"]  # from the relist after 410


async def test_watch_relists_after_410_gone(apiserver):
    apiserver.lists += ["endpointslices-list.json", "endpointslices-list-relist.json"]
    apiserver.watches.append("endpointslices-watch-gone.jsonl")
    discovery = KubernetesDiscovery(apiserver.api_client(), NS, SERVICES, watch_timeout_seconds=5)
    stream = discovery.watch()
    assert await asyncio.wait_for(anext(stream), 10) == LISTED
    relisted = await asyncio.wait_for(anext(stream), 10)
    await stream.aclose()
    assert relisted == [
        ep("rollout", "rollout-0", "10.244.1.23:50053"),
        ep("rollout", "rollout-2", "10.244.3.6:50053"),
        ep("trainer", "trainer-0", "10.244.1.17:50052"),
        ep("trainer", "trainer-1", "10.244.2.9:50052"),
    ]
    lists = [q for m, p, q in apiserver.requests if "watch" not in q]
    assert len(lists) == 2


def test_discovery_rejects_unknown_kinds():
    with pytest.raises(ValueError, match="trainer"):
        KubernetesDiscovery(client.ApiClient(), NS, {"svc": "gateway"})


# --- leader election ----------------------------------------------------------------------

FAST = {"lease_duration": 1.0, "renew_deadline": 0.6, "retry_period": 0.1}


def elector(server: FakeApiServer, who: str, log: list, **kwargs) -> LeaderElector:
    def started() -> None:
        log.append((time.monotonic(), who, "start"))

    def stopped() -> None:
        log.append((time.monotonic(), who, "stop"))

    return LeaderElector(
        server.api_client(who),
        NS,
        LEASE,
        who,
        on_started_leading=started,
        on_stopped_leading=stopped,
        **{**FAST, **kwargs},
    )


async def watch_leaders(electors: list[LeaderElector], seconds: float) -> set[str]:
    """Who believed it led at some instant of `seconds` (sampled every 5 ms). Beliefs may
    overlap on a starved machine (a thread that has not yet noticed its lease ran out):
    safety is what the store accepts, checked through `Actor`, not what electors believe."""
    leaders: set[str] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        leaders.update(e.identity for e in electors if e.is_leader)
        await asyncio.sleep(0.005)
    return leaders


class Actor:
    """One controller's dispatch while its elector says it leads: it takes a leader epoch
    when it starts leading, then keeps submitting, claiming and completing operations of one
    registration, each result naming (who, epoch). Writes of a superseded epoch are refused
    by the store, so the recorded results show who actually acted, in order."""

    def __init__(self, who: str, store: Store, settings: ControllerSettings, rid: str) -> None:
        self.who, self.store, self.rid = who, store, rid
        self.ledger = Ledger(store, settings, Notifier(store))
        self.elector: LeaderElector | None = None
        self.task: asyncio.Task[None] | None = None
        self.refused = 0

    async def started(self) -> None:
        await self.store.take_epoch()
        self.task = asyncio.create_task(self._act())

    async def stopped(self) -> None:
        self.store.drop_epoch()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _act(self) -> None:
        result = f"{self.who}:{self.store.epoch}".encode()
        keys = self.store.keys
        while self.elector is not None and self.elector.is_leader:
            try:
                for opid in await self.ledger.claimed_ids():  # left by a deposed leader
                    if await self.ledger.load_claim(opid) is not None:
                        await self.ledger.complete(opid, OpState.SUCCEEDED, result)
                seq = int(await self.store.redis.hget(keys.reg(self.rid), "max_seq") or 0) + 1
                await self.ledger.submit("t", self.rid, seq, 3, b"x", f"d{seq}")
                group = keys.group_of(self.rid)
                for claim in await self.ledger.claim_many(group, [], 4):
                    await self.ledger.complete(claim.operation_id, OpState.SUCCEEDED, result)
            except StaleEpoch:
                self.refused += 1
            except LorafleetError:  # a seq_id raced by the other controller: go on
                pass
            await asyncio.sleep(0.01)  # a steady trickle: the history stays short to check


async def acted(store: Store, rid: str) -> list[tuple[str, int]]:
    """(who, epoch) of every completed operation, in seq order (= execution order)."""
    max_seq = int(await store.redis.hget(store.keys.reg(rid), "max_seq") or 0)
    async with store.redis.pipeline(transaction=False) as pipe:
        for seq in range(1, max_seq + 1):
            pipe.hget(store.keys.op(f"{rid}#{seq}"), "result")
        results = await pipe.execute()
    out = []
    for result in results:
        if result:
            who, epoch = result.decode().split(":")
            out.append((who, int(epoch)))
    return out


async def ready_registration(store: Store, settings: ControllerSettings) -> str:
    registry = Registry(store, settings)
    await registry.register_replica(Replica("trainer", "tr", "127.0.0.1:1", "m", 4, "i", 0, True))
    rec, _ = await registry.create(
        "t", "s", 0, "m", common_pb2.LoraConfig(rank=4), {}, "adamw", False
    )
    placement = await registry.place(rec.registration_id)
    assert await registry.bound(rec.registration_id, placement.replica, placement.slot)
    return rec.registration_id


async def test_two_electors_never_both_lead(apiserver, redis_server):
    """Safety under starvation: never two leaders *acting*. Each elector drives a real ledger
    (fenced by the leader epoch); the store's record of who completed each operation must
    show leadership terms one after the other, never interleaved."""
    settings = ControllerSettings(
        redis_url=redis_server.url,
        max_pending_per_registration=100_000,
        max_unacked_results_per_tenant=1_000_000,
        max_pending_per_tenant=1_000_000,
    )
    client = connect(redis_server.url)
    setup = Store(client, settings.key_prefix, settings.ledger_groups)
    rid = await ready_registration(setup, settings)
    log: list = []
    actors = {
        who: Actor(who, Store(client, settings.key_prefix, settings.ledger_groups), settings, rid)
        for who in ("a", "b")
    }
    electors = []
    for who, actor in actors.items():

        async def started(who: str = who, actor: Actor = actor) -> None:
            log.append((time.monotonic(), who, "start"))
            await actor.started()

        async def stopped(who: str = who, actor: Actor = actor) -> None:
            log.append((time.monotonic(), who, "stop"))
            await actor.stopped()

        actor.elector = LeaderElector(
            apiserver.api_client(who),
            NS,
            LEASE,
            who,
            on_started_leading=started,
            on_stopped_leading=stopped,
            **FAST,
        )
        electors.append(actor.elector)
    tasks = [asyncio.create_task(e.run()) for e in electors]
    try:

        def started_since(who: str, since: float) -> list[float]:
            return [t for t, w, what in log if w == who and what == "start" and t >= since]

        await wait_until(lambda: log and log[-1][2] == "start")
        first = next(e for e in electors if e.identity == log[-1][1])
        other = next(e for e in electors if e is not first)
        await asyncio.sleep(0.3)  # the first leader acts for a while
        # Partition the leader from the API server: the other takes over, and from then on
        # the partitioned one's writes are refused even while it still believes it leads.
        apiserver.blocked.add(first.identity)
        cut = time.monotonic()
        terms = [what for _, w, what in log if w == other.identity]
        if not terms or terms[-1] != "start":  # (a starved first leader may have flapped)
            await wait_until(lambda: started_since(other.identity, cut))
            # It waited for the lease to expire: the old leader's last accepted write was at
            # most one retry period before the cut.
            assert started_since(other.identity, cut)[0] - cut >= (
                FAST["lease_duration"] - 2 * FAST["retry_period"]
            )
        await asyncio.sleep(0.3)  # the new leader acts for a while
        # The old leader comes back: terms may change again, never overlap in the store.
        apiserver.blocked.clear()
        await watch_leaders(electors, 1.0)
        await wait_until(lambda: any(e.is_leader for e in electors))
    finally:
        apiserver.blocked.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    history = await acted(setup, rid)
    await client.aclose()
    assert {who for who, _ in history} >= {first.identity, other.identity}
    terms = [epoch for _, epoch in history]
    assert terms == sorted(terms), "a superseded leader's write landed after a newer one's"
    owners: dict[int, str] = {}
    for who, epoch in history:
        assert owners.setdefault(epoch, who) == who, f"epoch {epoch} used by two controllers"
    assert {holder for _, holder in apiserver.lease_writes} >= {"a", "b"}
    assert apiserver.lease["spec"]["leaseTransitions"] >= 1


async def test_racing_candidates_one_wins_by_resource_version(apiserver):
    """Both read an expired lease and try to replace it: the 409 loser does not lead."""
    apiserver.lease = json.loads(recorded("lease.json"))  # held by a long-gone controller
    apiserver.lease["spec"]["leaseDurationSeconds"] = 1
    candidates = [elector(apiserver, who, []) for who in ("a", "b", "c", "d")]
    for c in candidates:  # first sighting of the old record starts each one's expiry clock
        assert c.try_acquire_or_renew() is False
    await asyncio.sleep(FAST["lease_duration"])
    results = await asyncio.gather(*(asyncio.to_thread(c.try_acquire_or_renew) for c in candidates))
    assert sum(results) == 1
    (winner,) = [c for c, won in zip(candidates, results, strict=True) if won]
    assert apiserver.lease["spec"]["holderIdentity"] == winner.identity
    assert [c.is_leader for c in candidates].count(True) == 1


async def test_leader_releases_the_lease_on_shutdown(apiserver):
    log: list = []
    a = elector(apiserver, "a", log, lease_duration=30.0, renew_deadline=20.0)
    task = asyncio.create_task(a.run())
    # Wait for the callback, not a fixed time: under load the first write may be slow, and
    # cancelling between the write and the callback would leave nothing to step down from.
    await wait_until(lambda: log)
    assert a.is_leader
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not a.is_leader
    assert [what for _, _, what in log] == ["start", "stop"]
    assert apiserver.lease["spec"].get("holderIdentity") is None
    # A standby takes the released lease at once instead of waiting 30 s for expiry.
    b = elector(apiserver, "b", [], lease_duration=30.0, renew_deadline=20.0)
    assert await asyncio.to_thread(b.try_acquire_or_renew) is True


async def test_a_cancel_as_a_renewal_lands_stops_the_leader(apiserver):
    """Shutdown while a renewal completes: the cancel wins. Python 3.11's `wait_for` returned
    the attempt's result instead and lost the cancel, so the elector (and the controller
    awaiting it) renewed forever; CI hung 600 s in the two-electors test on exactly this."""
    log: list = []
    a = elector(apiserver, "a", log, lease_duration=30.0, renew_deadline=20.0)
    task = asyncio.create_task(a.run())
    await wait_until(lambda: log)
    apiserver.blocked.add("a")  # hold the next renewal in flight, well inside its budget
    held = len(apiserver.requests)
    await wait_until(lambda: len(apiserver.requests) > held and a._attempts)
    (attempt,) = a._attempts
    # Callbacks run in the order added: the elector's own wake-up is scheduled first, then
    # this cancel, both in the loop iteration where the attempt lands.
    attempt.add_done_callback(lambda _: task.cancel())
    apiserver.blocked.clear()
    await wait_until(task.done)
    assert task.cancelled()
    assert [what for _, _, what in log] == ["start", "stop"]
    assert not a.is_leader
    assert apiserver.lease["spec"].get("holderIdentity") is None


async def test_cancel_during_the_first_read_writes_nothing(apiserver):
    """An attempt whose read is held past shutdown does not go on to take the lease."""
    a = elector(apiserver, "a", [], lease_duration=30.0, renew_deadline=20.0)
    apiserver.blocked.add("a")
    task = asyncio.create_task(a.run())
    await wait_until(lambda: apiserver.requests)  # a's first read is held by the "partition"
    task.cancel()
    await asyncio.sleep(0.1)
    apiserver.blocked.clear()  # the read is answered (404) after the cancel
    await asyncio.gather(task, return_exceptions=True)
    assert apiserver.lease_writes == []
    assert apiserver.lease is None
    assert not a.is_leader


async def test_attempts_held_past_a_step_down_never_write(apiserver):
    """A leader cut off from the API server steps down at its renew deadline, abandoning the
    attempts the partition holds. When the partition heals after someone else has taken and
    released the lease, those attempts must not write the deposed leader back in as holder:
    nobody would lead, and a standby would wait a whole lease duration to take over."""
    log: list = []
    a = elector(apiserver, "a", log)
    task = asyncio.create_task(a.run())
    await wait_until(lambda: log)
    apiserver.blocked.add("a")
    await wait_until(lambda: [what for _, _, what in log] == ["start", "stop"])
    with apiserver.lock:  # another controller took the lease over, then released it
        apiserver.lease["spec"]["holderIdentity"] = None
        apiserver.version += 1
        apiserver.lease["metadata"]["resourceVersion"] = str(apiserver.version)
    written = len(apiserver.lease_writes)
    task.cancel()
    await asyncio.sleep(0.1)
    apiserver.blocked.clear()  # the held reads are answered now: holder None
    await asyncio.gather(task, return_exceptions=True)
    assert apiserver.lease_writes[written:] == []
    assert apiserver.lease["spec"].get("holderIdentity") is None


async def test_a_live_lease_is_respected(apiserver):
    lease = json.loads(recorded("lease.json"))
    apiserver.lease = copy.deepcopy(lease)
    b = elector(apiserver, "b", [])
    for _ in range(3):  # the holder keeps renewing: b never takes over
        assert await asyncio.to_thread(b.try_acquire_or_renew) is False
        apiserver.lease["spec"]["renewTime"] = f"2025-11-29T14:0{_ + 7}:00.000000Z"
        await asyncio.sleep(FAST["lease_duration"] * 0.6)
    assert apiserver.lease["spec"]["holderIdentity"] == lease["spec"]["holderIdentity"]
    assert not b.is_leader


def test_elector_rejects_unsafe_timings():
    with pytest.raises(ValueError, match="renew_deadline"):
        LeaderElector(client.ApiClient(), NS, LEASE, "a", lease_duration=5, renew_deadline=5)
