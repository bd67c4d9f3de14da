"""Ledger throughput and latency on a real redis-server, with no-op trainer work.

    .venv/bin/python bench/ledger.py [--registrations 64] [--ops 20000] [--consumers 4]
        [--admission-rate 0]
    .venv/bin/python bench/ledger.py --cluster [--masters 3] [--workers 4] [--rounds 2]
        [--groups 24]
    .venv/bin/python bench/ledger.py --durability [--rounds 2]

Producers submit forward_backward ops for many registrations (each registration's ops in
seq order, as the SDK sends them); consumers do what the scheduler does (BLPOP the ready
lists, claim everything ready in one call, record the batch's results in one call) with no
trainer call in between. Runs twice side by side, with the `pipeline_submits` setting on
(concurrent submits share one Redis pipeline) and off, on one redis-server under separate
key prefixes. Prints JSON per mode: submit→claimed latency p50/p99 (ms), the submit call's
own p50/p99, sustained completed ops/s, the idle submit→claimed latency, and the ratio.

`--cluster` (issue 24 item 4) runs the same workload on one redis-server and on a
`--masters`-master Redis Cluster started like the test fixture, side by side in one run
(alternating, `--rounds` times each), both with the fleet's keys in `--groups` groups
(store/keys.py), and prints each side's ops/s, the ratio cluster / one master (the goal is
≥ 2.5 on 3 masters) and how many script calls each master served (the groups spread them).
One Python process cannot load three masters, so each side drives the ledger from
`--workers` processes; the registrations are split among them, and each group's ready
queues are claimed by one loop in one worker (as the scheduler runs one per group).

`--durability` (issue 37 item 1) runs the pipelined workload on three redis-servers side by
side, alternating `--rounds` times: no AOF, `appendfsync everysec` and `appendfsync always`
(the chart's default: a write is on disk before it is acknowledged), and prints each one's
ops/s and latencies and the ratios always / everysec and always / no AOF: what durable
acknowledgement costs on this machine's disk.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import redis
import redis.asyncio as aioredis

from lorafleet.testing import start_redis, start_redis_cluster
from lorafleet.v1 import common_pb2
from lorafleet_controller import ledger as L
from lorafleet_controller.notify import Notifier
from lorafleet_controller.registry import Registry, Replica
from lorafleet_controller.scheduler import CLAIM_BATCH
from lorafleet_controller.settings import ControllerSettings
from lorafleet_controller.store import OpState, Store, connect


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


async def run(
    args: argparse.Namespace, url: str, pipelined: bool, prefix: str
) -> dict[str, object]:
    settings = ControllerSettings(
        redis_url=url,
        key_prefix=prefix,
        max_pending_per_registration=1024,
        max_unacked_results=10_000_000,
        max_pending_global=10_000_000,
        max_unacked_results_per_tenant=10_000_000,
        max_pending_per_tenant=10_000_000,
        pipeline_submits=pipelined,
        admission_rate_per_tenant=args.admission_rate,
        admission_burst_per_tenant=10_000_000,
    )
    client = aioredis.from_url(url)
    await client.config_resetstat()  # Redis's own time per script call, for this run only
    store = Store(client, settings.key_prefix, settings.ledger_groups)
    await store.take_epoch()
    notifier = Notifier(store)
    await notifier.start()
    ledger = L.Ledger(store, settings, notifier)
    registry = Registry(store, settings)
    await registry.register_replica(
        Replica("trainer", "bench", "127.0.0.1:1", "base", args.registrations, "i", 0, True)
    )
    rids = []
    for i in range(args.registrations):
        rec, _ = await registry.create(
            "t", "bench", i, "base", common_pb2.LoraConfig(rank=4), {}, "adamw", False
        )
        placement = await registry.place(rec.registration_id)
        await registry.bound(rec.registration_id, placement.replica, placement.slot)
        rids.append(rec.registration_id)

    per_reg = args.ops // args.registrations
    total = per_reg * args.registrations
    submitted: dict[str, float] = {}
    claim_lat: list[float] = []
    submit_lat: list[float] = []
    done = asyncio.Event()
    completed = 0
    payload = b"x" * 256

    finished: dict[str, asyncio.Event] = {}

    async def producer(rid: str) -> None:
        for seq in range(1, per_reg + 1):
            opid = L.operation_id(rid, seq)
            finished[opid] = asyncio.Event()
            t0 = time.perf_counter()
            submitted[opid] = t0
            await ledger.submit("t", rid, seq, 2, payload, f"d{seq}")
            submit_lat.append(time.perf_counter() - t0)
            if args.lockstep:  # wait for the op to finish: latency of an idle system
                await finished[opid].wait()

    async def consumer() -> None:
        nonlocal completed
        conn = aioredis.from_url(url)
        while not done.is_set():
            ready = store.keys.group(0)  # one group: the bench runs the G = 1 layout
            popped = await conn.blpop([ready.ready_ctl, ready.ready_data], timeout=0.2)
            if popped is None:
                continue
            claims = await ledger.claim_many(0, [popped[1].decode()], CLAIM_BATCH)
            now = time.perf_counter()
            claim_lat.extend(now - submitted[c.operation_id] for c in claims)
            await ledger.complete_many(
                [L.Outcome(c.operation_id, OpState.SUCCEEDED, b"r") for c in claims]
            )
            for c in claims:
                finished[c.operation_id].set()
            completed += len(claims)
            if completed >= total:
                done.set()
        await conn.aclose()

    start = time.perf_counter()
    consumers = [asyncio.create_task(consumer()) for _ in range(args.consumers)]
    await asyncio.gather(*(producer(r) for r in rids))
    await done.wait()
    elapsed = time.perf_counter() - start
    await asyncio.gather(*consumers)
    await notifier.stop()
    scripts = (await client.info("commandstats")).get("cmdstat_evalsha", {})
    await client.aclose()
    return {
        "redis_usec_per_script_call": scripts.get("usec_per_call"),
        "registrations": args.registrations,
        "ops": total,
        "consumers": args.consumers,
        "submit_to_claimed_ms": {
            "p50": round(pct(claim_lat, 0.5), 3),
            "p99": round(pct(claim_lat, 0.99), 3),
        },
        "submit_call_ms": {
            "p50": round(pct(submit_lat, 0.5), 3),
            "p99": round(pct(submit_lat, 0.99), 3),
        },
        "ops_per_second": round(total / elapsed, 1),
        "mean_claim_ms": round(statistics.fmean(claim_lat) * 1000, 3),
    }


async def idle_latency(
    url: str, n: int, pipelined: bool, prefix: str, admission_rate: float
) -> dict[str, float]:
    """Submit→claimed with one registration and an idle consumer (no queueing)."""
    args = argparse.Namespace(
        registrations=1, ops=n, consumers=1, lockstep=True, admission_rate=admission_rate
    )
    out = await run(args, url, pipelined, prefix + "idle:")
    return out["submit_to_claimed_ms"]  # type: ignore[return-value]


async def cluster_setup(
    args: argparse.Namespace, url: str, cluster: bool, prefix: str
) -> tuple[int, list[str]]:
    """Registrations placed and bound on one replica record; returns the leader epoch the
    workers dispatch under (taken once here, so no worker supersedes another)."""
    client = connect(url, cluster=cluster)
    store = Store(client, prefix, args.groups)
    await store.check_layout()
    epoch = await store.take_epoch()
    registry = Registry(store, cluster_settings(url, cluster, prefix, args.groups))
    await registry.register_replica(
        Replica("trainer", "bench", "127.0.0.1:1", "base", args.registrations, "i", 0, True)
    )
    rids = []
    for i in range(args.registrations):
        rec, _ = await registry.create(
            f"t{i % args.tenants}",
            "bench",
            i,
            "base",
            common_pb2.LoraConfig(rank=4),
            {},
            "adamw",
            False,
        )
        placement = await registry.place(rec.registration_id)
        await registry.bound(rec.registration_id, placement.replica, placement.slot)
        rids.append(rec.registration_id)
    await client.aclose()
    return epoch, rids


def cluster_settings(url: str, cluster: bool, prefix: str, groups: int) -> ControllerSettings:
    return ControllerSettings(
        redis_url=url,
        redis_cluster=cluster,
        key_prefix=prefix,
        ledger_groups=groups,
        max_pending_per_registration=1024,
        max_unacked_results=10_000_000,
        max_pending_global=10_000_000,
        max_unacked_results_per_tenant=10_000_000,
        max_pending_per_tenant=10_000_000,
        max_registrations_per_tenant=1_000_000,
        admission_rate_per_tenant=0.0,  # the bucket off, as in the default mode above
        # One EVALSHA per call on both sides: redis-py refuses EVALSHA in a Cluster pipeline
        # (store/coalesce.py), so the one-server side must not share round trips either.
        pipeline_submits=False,
    )


async def cluster_worker_main(
    url: str,
    cluster: bool,
    prefix: str,
    epoch: int,
    rids: list[str],
    tenants: dict[str, str],
    per_reg: int,
    groups: int,
    claim_groups: list[int],
    total: int,
    completed: multiprocessing.Value,
    start: multiprocessing.Barrier,
) -> dict[str, float]:
    """One worker process: producers for its registrations, a claim loop per group of
    `claim_groups` (as the scheduler runs one per group)."""
    client = connect(url, cluster=cluster)
    store = Store(client, prefix, groups)
    store.epoch = epoch
    # Never started: only `Ledger.wait` listens, and the workload does not wait.
    settings = cluster_settings(url, cluster, prefix, groups)
    ledger = L.Ledger(store, settings, Notifier(store))
    payload = b"x" * 256
    submit_lat: list[float] = []

    async def producer(rid: str) -> None:
        for seq in range(1, per_reg + 1):
            t0 = time.perf_counter()
            await ledger.submit(tenants[rid], rid, seq, 2, payload, f"d{seq}")
            submit_lat.append(time.perf_counter() - t0)

    async def consumer(group: int) -> None:
        conn = connect(url, cluster=cluster)
        ready = store.keys.group(group)
        while completed.value < total:
            popped = await conn.blpop([ready.ready_ctl, ready.ready_data], timeout=0.2)
            if popped is None:
                continue
            claims = await ledger.claim_many(group, [popped[1].decode()], CLAIM_BATCH)
            await ledger.complete_many(
                [L.Outcome(c.operation_id, OpState.SUCCEEDED, b"r") for c in claims]
            )
            with completed.get_lock():
                completed.value += len(claims)
        await conn.aclose()

    await asyncio.get_running_loop().run_in_executor(None, start.wait, 300)
    loops = [asyncio.create_task(consumer(g)) for g in claim_groups]
    await asyncio.gather(*(producer(r) for r in rids))
    await asyncio.gather(*loops)
    finished = time.time()
    await client.aclose()
    return {
        "finished": finished,
        "submit_p50_ms": round(pct(submit_lat, 0.5), 3),
        "submit_p99_ms": round(pct(submit_lat, 0.99), 3),
    }


def cluster_worker(out: multiprocessing.Queue, *a: object) -> None:
    try:
        out.put(asyncio.run(cluster_worker_main(*a)))  # type: ignore[arg-type]
    except BaseException:  # the parent must not wait for a worker that died
        out.put({"error": traceback.format_exc()})
        raise


def script_calls(ports: list[int]) -> list[int]:
    """EVALSHA calls each node served since its stats were last reset."""
    calls = []
    for port in ports:
        node = redis.Redis(port=port)
        calls.append(int(node.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)))
        node.config_resetstat()
        node.close()
    return calls


def cluster_side(
    args: argparse.Namespace, url: str, cluster: bool, ports: list[int], prefix: str
) -> dict[str, object]:
    """The workload once, from `args.workers` processes; completed ops/s over the run."""
    epoch, rids = asyncio.run(cluster_setup(args, url, cluster, prefix))
    tenants = {rid: f"t{i % args.tenants}" for i, rid in enumerate(rids)}
    script_calls(ports)  # reset: count the workload only
    per_reg = args.ops // args.registrations
    total = per_reg * len(rids)
    ctx = multiprocessing.get_context("spawn")
    completed = ctx.Value("q", 0)
    start = ctx.Barrier(args.workers + 1)
    results: multiprocessing.Queue = ctx.Queue()
    procs = [
        ctx.Process(
            target=cluster_worker,
            args=(
                results,
                url,
                cluster,
                prefix,
                epoch,
                rids[w :: args.workers],
                tenants,
                per_reg,
                args.groups,
                list(range(w, args.groups, args.workers)),
                total,
                completed,
                start,
            ),
        )
        for w in range(args.workers)
    ]
    for p in procs:
        p.start()
    start.wait(300)  # a worker that died before it arrives breaks the barrier
    began = time.time()
    outs = []
    for _ in procs:
        outs.append(results.get(timeout=3600))
        if "error" in outs[-1]:  # the others would wait for its operations forever
            for p in procs:
                p.terminate()
            raise RuntimeError(f"a worker failed: {outs[-1]['error']}")
    for p in procs:
        p.join()
    elapsed = max(o["finished"] for o in outs) - began
    return {
        "ops": total,
        "ops_per_second": round(total / elapsed, 1),
        "script_calls_per_master": script_calls(ports),
        "submit_call_p50_ms": round(statistics.median(o["submit_p50_ms"] for o in outs), 3),
        "submit_call_p99_ms": max(o["submit_p99_ms"] for o in outs),
    }


def cluster_main(args: argparse.Namespace) -> None:
    load = os.getloadavg()[0]
    sides: dict[str, list[dict[str, object]]] = {"one_master": [], "cluster": []}
    with tempfile.TemporaryDirectory() as tmp:
        single = start_redis(Path(tmp) / "single")
        try:
            nodes = start_redis_cluster(Path(tmp) / "cluster", masters=args.masters)
        except BaseException:
            single.stop()
            raise
        try:
            for r in range(args.rounds):  # alternate, so a busy moment hits both sides
                sides["one_master"].append(
                    cluster_side(args, single.url, False, [single.port], f"lf-r{r}:")
                )
                sides["cluster"].append(
                    cluster_side(args, nodes.url, True, [n.port for n in nodes.nodes], f"lf-r{r}:")
                )
        finally:
            nodes.stop()
            single.stop()
    best = {k: max(float(s["ops_per_second"]) for s in v) for k, v in sides.items()}  # type: ignore[arg-type]
    print(
        json.dumps(
            {
                "masters": args.masters,
                "workers": args.workers,
                "groups": args.groups,
                "registrations": args.registrations,
                "tenants": args.tenants,
                "rounds": sides,
                "best_ops_per_second": best,
                "cluster_over_one_master_ops_ratio": round(best["cluster"] / best["one_master"], 3),
                "goal_ratio": 2.5,
                "cpus": os.cpu_count(),
                "loadavg_1m": {"before": round(load, 2), "after": round(os.getloadavg()[0], 2)},
            },
            indent=2,
        )
    )


AOF_MODES = {
    "no_aof": ["--appendonly", "no"],
    "everysec": ["--appendonly", "yes", "--appendfsync", "everysec"],
    "always": ["--appendonly", "yes", "--appendfsync", "always"],
}


def durability_main(args: argparse.Namespace) -> None:
    """The pipelined workload against each AOF policy, alternating rounds (see the docstring)."""
    load = os.getloadavg()[0]
    rounds: dict[str, list[dict[str, object]]] = {name: [] for name in AOF_MODES}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            name: start_redis(Path(tmp) / name, extra=extra) for name, extra in AOF_MODES.items()
        }
        try:
            for r in range(args.rounds):
                for name, server in servers.items():
                    rounds[name].append(asyncio.run(run(args, server.url, True, f"lf-{r}:")))
        finally:
            for server in servers.values():
                server.stop()

    def best(name: str, key: str) -> float:
        return max(float(x[key]) for x in rounds[name])  # type: ignore[arg-type]

    out: dict[str, object] = {"rounds": rounds}
    for other in ("everysec", "no_aof"):
        out[f"always_over_{other}_ops_ratio"] = round(
            best("always", "ops_per_second") / best(other, "ops_per_second"), 3
        )
    out["submit_call_p50_ms"] = {
        name: [x["submit_call_ms"]["p50"] for x in rounds[name]]  # type: ignore[index]
        for name in AOF_MODES
    }
    out["loadavg_1m"] = {"before": round(load, 2), "after": round(os.getloadavg()[0], 2)}
    print(json.dumps(out, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--registrations", type=int, default=64)
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--consumers", type=int, default=4)
    # Like the limits above, the tenant's admission bucket is off (0) by default: this measures
    # the ledger's throughput. Any rate it never reaches (1e6) measures what the bucket costs.
    parser.add_argument("--admission-rate", type=float, default=0.0)
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="one master vs a Redis Cluster, side by side (see the docstring)",
    )
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--groups",
        type=int,
        default=24,
        help="--cluster: the fleet's ledger_groups on both sides (store/keys.py); about 8 "
        "per master, since claims and outcomes batch per group",
    )
    parser.add_argument(
        "--durability",
        action="store_true",
        help="no AOF vs appendfsync everysec vs always, side by side (see the docstring)",
    )
    args = parser.parse_args()
    args.lockstep = False
    if args.durability:
        durability_main(args)
        return
    if args.cluster:
        cluster_main(args)
        return
    load = os.getloadavg()[0]  # this machine is shared: report how busy it was
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = start_redis(Path(tmp) / "redis")
        try:
            for name, pipelined in (("plain", False), ("pipelined", True)):
                loaded = asyncio.run(run(args, server.url, pipelined, f"lf-{name}:"))
                loaded["unloaded_submit_to_claimed_ms"] = asyncio.run(
                    idle_latency(server.url, 2000, pipelined, f"lf-{name}:", args.admission_rate)
                )
                out[name] = loaded
        finally:
            server.stop()
    ratio = out["pipelined"]["ops_per_second"] / out["plain"]["ops_per_second"]  # type: ignore[index]
    out["pipelined_over_plain_ops_ratio"] = round(ratio, 3)
    out["redis_parser"] = "hiredis" if importlib.util.find_spec("hiredis") else "python"
    out["loadavg_1m"] = {"before": round(load, 2), "after": round(os.getloadavg()[0], 2)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
