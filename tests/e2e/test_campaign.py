"""A fault campaign (issue 26 item 7): seven tenants train at once under `lorafleet up`'s
supervision while a seeded injector applies random faults at random times, and every tenant
must end where a fault-free run of the same seeds ends, with every operation applied once.

Tenants (tests/e2e/campaign_script.py, the real tinker SDK and the gateway's REST): four
training loops with different losses and ranks, one that also publishes and samples every
step, one managed job, and a canary on a trainer of its own (a second base model name, so
placement never puts anyone else there and no fault touches it).

Faults, drawn from `CAMPAIGN_SEED`: SIGKILL or SIGSTOP (1 s to `CAMPAIGN_STOP_MAX_S`, 20 s in
the issue, 4 s in CI) of Redis, the controller, the shared trainer, the rollout or the
gateway; connection resets on the gateway↔controller and controller↔trainer links (a small
TCP proxy of our own sits on each: the gateway's controller address and the trainer's
advertised address point at it); a full disk on the checkpoint store (the storage root is a
size-limited tmpfs, filled to the last byte and freed again; mounting needs root, else the
kind is left out and the figures say so); a page-out forced at random (PageOutRegistration,
with or without `force`) of a training run other than the canary's.

At the end, for every tenant, against the reference run (same seeds, the same number of
steps, on the same fleet, no faults): every operation's result (losses, per-token logprobs
and losses, optimizer metrics, sampled tokens and logprobs, the job's result) and the final
state's adapter weights and Adam moments are bit-identical, the controller running every
trainer pass with one operation (`max_batch_operations`), so no result depends on which
co-tenants shared a pass; the
ledger (Redis) holds the same operations, none failed; the controller's and the trainer's
optimizer step counts equal the steps the client took; the operations the trainer applied
(its own record in the saved state) are in the ledger and are the reference's.
`CAMPAIGN_FAULTS` (20 in CI) sets the count; the figures (faults by kind, page-out outcomes,
divergences, how far apart each tenant ended, the longest recovery, the restore points each
run left in the checkpoint store) print as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from safetensors.torch import load as load_tensors

from lorafleet import hub
from lorafleet.testing import free_port
from lorafleet.v1 import controller_pb2, controller_pb2_grpc
from lorafleet_controller.store.keys import Keys
from lorafleet_controller.store.states import OpState
from lorafleet_trainer.checkpoint import TRAINER_STATE
from lorafleet_trainer.snapshots import PAGE_MARK
from lorafleet_trainer.snapshots import PREFIX as SNAPSHOT_PREFIX

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
FAULTS = int(os.environ.get("CAMPAIGN_FAULTS", "20"))
SEED = int(os.environ.get("CAMPAIGN_SEED", "2026"))
STOP_MAX_S = float(os.environ.get("CAMPAIGN_STOP_MAX_S", "4"))
GAP_MAX_S = 3.0  # most time between two faults
MIN_STEPS = 3  # every training tenant takes at least this many steps
CANARY_MODEL = "lorafleet/campaign-canary"
# Where another tenant's rows share a trainer pass, the padded width and BLAS blocking
# change the last bits, and training grows that: at CAMPAIGN_FAULTS=500 with shared passes
# (716-778 steps each) results drifted from 1e-7 at the first operation past 1e-2 after
# 316-460 steps, while every count, seq_id and state agreed, and a relative bound could not
# tell a fault's damage from rounding. So every pass holds one operation, and every tenant
# must be bit-identical, like the canary alone on its trainer.
ONE_PER_PASS = {"LORAFLEET_CONTROLLER_MAX_BATCH_OPERATIONS": "1"}
LEDGER_PREFIX = "lf:"  # the controller's default key prefix, which `lorafleet up` keeps
STORE_BYTES = 256 << 20  # the checkpoint store's tmpfs
PROCESSES = ("redis", "controller", "trainer-0", "rollout-0", "gateway")
TENANTS = [  # name, kind, loss, rank, seed
    ("ce", "train", "cross_entropy", 4, 11),
    ("is", "train", "importance_sampling", 8, 12),
    ("ppo", "train", "ppo", 16, 13),
    ("cispo", "train", "cispo", 2, 14),
    ("sampler", "sampler", "cross_entropy", 8, 15),
    ("job", "job", "", 0, 16),
    ("canary", "train", "cross_entropy", 8, 17),
]
JOB_PAIRS = [{"Q": "What is my name?", "A": "Dima"}, {"Q": "Where do I live?", "A": "Lisbon"}]
JOB_PARAMS = {
    "seed": "16",
    "max_iters": "2",
    "learning_rate": "0.005",
    "loss_target": "0",
    "early_stop": "0",
}


class ResettingProxy:
    """A TCP proxy on a free loopback port to `target()`'s port, whose `reset()` aborts every
    connection through it with a RST (SO_LINGER 0), as a dropped link looks to both ends.
    TLS passes through untouched. Runs its own event loop in a daemon thread."""

    def __init__(self, target: Callable[[], int]) -> None:
        self.target = target
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.writers: set[asyncio.StreamWriter] = set()
        started = threading.Event()
        threading.Thread(target=self._serve, args=(started,), daemon=True).start()
        started.wait()

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", self.port)
        )
        started.set()
        with contextlib.suppress(RuntimeError):
            self.loop.run_forever()
        server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target())
        except OSError:  # the target is down (being restarted): the caller sees a reset
            writer.transport.abort()
            return
        pair = {writer, up_writer}
        self.writers |= pair

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.writers -= pair

    def reset(self) -> int:
        """Abort every open connection; returns how many were cut."""

        def cut() -> int:
            n = 0
            for w in list(self.writers):
                sock = w.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(
                            socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                        )
                w.transport.abort()
                n += 1
            self.writers.clear()
            return n

        async def run() -> int:
            return cut()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextlib.contextmanager
def size_limited_store(folder: Path) -> Iterator[bool]:
    """Mount a STORE_BYTES tmpfs on `folder` (the fleet's storage root); yields whether it
    could (mounting needs root: without it the disk-full kind is left out)."""
    folder.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={STORE_BYTES}", "tmpfs", str(folder)]
    mounted = os.geteuid() == 0 and subprocess.run(mount, capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def fill_disk(folder: Path) -> Path:
    """Write zeros into `folder` until the filesystem refuses another byte."""
    filler = folder / ".campaign-filler"
    block = b"\0" * (1 << 20)
    with open(filler, "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(block)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
    return filler


class Injector:
    """Applies `count` faults drawn from `rng` at random times, one after another (a stop or a
    full disk is held for its duration; the next fault comes 0.2 s to GAP_MAX_S later)."""

    def __init__(
        self,
        fleet: Any,
        proxies: dict[str, ResettingProxy],
        store: Path | None,
        runs: dict[str, str],
        rng: random.Random,
        count: int,
    ) -> None:
        self.fleet, self.proxies, self.store, self.runs, self.rng, self.count = (
            fleet,
            proxies,
            store,
            runs,
            rng,
            count,
        )
        self.kinds = [
            *(f"kill {p}" for p in PROCESSES),
            *(f"stop {p}" for p in PROCESSES),
            *(f"reset {link}" for link in proxies),
            "page out",
            *(["disk full"] if store is not None else []),
        ]
        self.pages: Counter[str] = Counter()  # page-out outcomes (a run may not be bound)
        self.log: list[tuple[str, float, float]] = []  # kind, injected at, released at
        self.error: BaseException | None = None
        self.done = threading.Event()

    def _signal(self, name: str, sig: signal.Signals) -> bool:
        proc = self.fleet.member(name).proc
        if proc.poll() is not None:  # down and not restarted yet: nothing to signal
            return False
        proc.send_signal(sig)
        return True

    def _apply(self, kind: str) -> None:
        verb, _, what = kind.partition(" ")
        started = time.time()
        if verb == "kill":
            self._signal(what, signal.SIGKILL)
        elif verb == "stop":
            hold = self.rng.uniform(1.0, STOP_MAX_S)
            if self._signal(what, signal.SIGSTOP):
                try:
                    time.sleep(hold)
                finally:
                    self._signal(what, signal.SIGCONT)
        elif verb == "reset":
            self.proxies[what].reset()
        elif verb == "page":
            self._page_out()
        else:  # disk full
            assert self.store is not None
            hold = self.rng.uniform(1.0, STOP_MAX_S)
            filler = fill_disk(self.store)
            try:
                time.sleep(hold)
            finally:
                filler.unlink()
        self.log.append((kind, started, time.time()))

    def _page_out(self) -> None:
        """Page a training run out (forced half the time: with un-stepped gradients it is
        rebuilt by replay); its next operation pages it in. Never the canary's."""
        tenant = self.rng.choice(sorted(t for t in self.runs if t != "canary"))
        force = self.rng.random() < 0.5
        request = controller_pb2.PageOutRegistrationRequest(
            registration_id=self.runs[tenant], force=force
        )
        try:
            with self.fleet.admin_channel() as ch:
                resp = controller_pb2_grpc.ControllerServiceStub(ch).PageOutRegistration(
                    request, timeout=30
                )
            outcome = controller_pb2.RegistrationState.Name(resp.state).lower()
        except grpc.RpcError as exc:  # refused (un-stepped gradients) or the controller is down
            outcome = exc.code().name.lower()
        self.pages[outcome.removeprefix("registration_state_")] += 1

    def run(self) -> None:
        try:
            for _ in range(self.count):
                time.sleep(self.rng.uniform(0.2, GAP_MAX_S))
                self._apply(self.rng.choice(self.kinds))
        except BaseException as exc:
            self.error = exc
        finally:
            self.done.set()


def run_tenants(
    python: Path,
    spec: dict[str, Any],
    out: Path,
    on_ready: Callable[[], None] | None = None,
    runs: dict[str, str] | None = None,
) -> dict[str, list[float]]:
    """Run campaign_script.py into `out`; returns each tenant's op completion times, and
    fills `runs` (tenant → run id) as the runs are created."""
    env = dict(
        os.environ,
        CAMPAIGN_SPEC=json.dumps(spec),
        CAMPAIGN_OUT=str(out),
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
    )
    proc = subprocess.Popen(
        [str(python), str(REPO / "tests" / "e2e" / "campaign_script.py")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    times: dict[str, list[float]] = {}
    stderr: list[str] = []
    drain = threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True)
    drain.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            word, *rest = line.split()
            if word == "READY" and on_ready is not None:
                on_ready()
            elif word == "RUN" and runs is not None:
                runs[rest[0]] = rest[1]
            elif word == "OP":
                times.setdefault(rest[0], []).append(float(rest[2]))
        code = proc.wait(timeout=1800)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    drain.join(timeout=10)
    out.with_name(out.name + ".stderr").write_text("".join(stderr))
    # The SDK logs a line per long-poll that answered try_again; a failure's traceback must
    # not scroll out behind them (a 500-fault run failed with nothing else in its message).
    told = [line for line in stderr if "Retrying request" not in line]
    retries = len(stderr) - len(told)
    assert code == 0, f"({retries} SDK retry lines left out)\n" + "".join(told)[-6000:]
    return times


def state_of(fleet: Any, path: str) -> dict[str, Any]:
    """A saved state's files: adapter and Adam moment bytes, and the trainer's own counters."""
    run, _, name = path.removeprefix("tinker://").partition("/weights/")
    folder = fleet.config.run_dir / "storage" / run / name
    trainer = json.loads((folder / "trainer_state.json").read_text())
    optimizer = folder / "optimizer.safetensors"
    return {
        "adapter": (folder / "adapter_model.safetensors").read_bytes(),
        "optimizer": optimizer.read_bytes() if optimizer.exists() else b"",
        "optim_steps": trainer["optim_steps"],
        "applied": trainer["applied_ops"],
    }


def restore_points(store: Path, rid: str) -> int:
    """The run's automatic snapshots and page-out saves left in the checkpoint store: each
    page-out deletes those its replay log moved past (the trainer's PruneSnapshots)."""
    folder = store / rid
    if not rid or not folder.is_dir():
        return 0
    return sum(
        1
        for p in folder.iterdir()
        if p.name.startswith(SNAPSHOT_PREFIX) or saved_by(p).startswith(rid + PAGE_MARK)
    )


def saved_by(folder: Path) -> str:
    """The operation id a saved state was written under; '' for anything else (a save's
    temporary folder left by a SIGKILLed trainer)."""
    try:
        return str(json.loads((folder / TRAINER_STATE).read_text()).get("saved_by", ""))
    except (OSError, ValueError):
        return ""


def ledger_of(r: redis.Redis, rid: str) -> dict[str, Any]:
    """The ledger's records of a run: op id → (kind, state), and the controller's step count."""
    keys = Keys(LEDGER_PREFIX, 1)  # the fleet runs the default layout: one group
    ops = {}
    for key in r.scan_iter(match=keys.op(rid + "#") + "*", count=1000):
        kind, state = r.hmget(key, "kind", "state")
        ops[key.decode().removeprefix(keys.op(""))] = (kind.decode(), OpState(int(state)).label)
    steps = r.hget(keys.reg(rid), "optim_steps")
    return {"ops": ops, "optim_steps": int(steps or 0)}


def seqs(op_ids: set[str]) -> list[int]:
    """The seq_ids of ledger operations (a restore's own id, `<run>#restore@...`, is none)."""
    return sorted(int(s) for i in op_ids if (s := i.rpartition("#")[2]).isdigit())


def recoveries(log: list[tuple[str, float, float]], times: dict[str, list[float]]) -> list[float]:
    """Per fault: from its release until every tenant still working completed an operation.
    Faults come 0.2-3 s apart, so one's figure includes whatever faults followed within it.
    The managed job reports one operation, its end, so it is left out (else its duration
    reads as every fault's recovery: 339 s for all 14 kinds at CAMPAIGN_FAULTS=100)."""
    out = []
    stepping = [ts for ts in times.values() if len(ts) > 1]
    for _, _, released in log:
        firsts = [next(t for t in ts if t > released) for ts in stepping if ts[-1] > released]
        out.append(max(firsts, default=released) - released)
    return out


def worst(a: Any, b: Any) -> float:
    """The largest difference between two results: |a - b| / max(1, |a|, |b|) over every
    float, inf where anything else (a token, a count, a shape, a word) differs."""
    if isinstance(a, float) or isinstance(b, float):
        if not isinstance(a, int | float) or not isinstance(b, int | float):
            return math.inf
        return abs(a - b) / max(1.0, abs(a), abs(b))
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return math.inf
        return max((worst(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return math.inf
        return max((worst(x, y) for x, y in zip(a, b, strict=True)), default=0.0)
    return 0.0 if a == b else math.inf


def tensors_apart(a: bytes, b: bytes) -> float:
    """The largest per-tensor ||a - b|| / ||b|| of two safetensors files (inf: other keys)."""
    if a == b:
        return 0.0
    ta, tb = load_tensors(a), load_tensors(b)
    if ta.keys() != tb.keys():
        return math.inf
    return max(
        float((ta[k].double() - tb[k].double()).norm() / tb[k].double().norm().clamp_min(1e-30))
        for k in ta
    )


def compare(
    fleet: Any, r: redis.Redis, name: str, kind: str, got: dict[str, Any], want: dict[str, Any]
) -> tuple[list[str], float]:
    """How one tenant's run under faults differs from its reference run (empty: within
    bounds), and the largest numeric difference seen."""
    if not got["final"] or not want["final"]:  # a job that failed: its error says why
        return [f"no final state: {got['ops'] if not got['final'] else want['ops']}"], math.inf
    diffs = []
    ops_got, ops_want = got["ops"], want["ops"]
    if kind == "job":  # its run and checkpoint names differ; nothing else may
        names = ("checkpoint", "runId")
        ops_got = [{k: v for k, v in o.items() if k not in names} for o in ops_got]
        ops_want = [{k: v for k, v in o.items() if k not in names} for o in ops_want]
    s_got, s_want = state_of(fleet, got["final"]), state_of(fleet, want["final"])
    apart = max(
        worst(ops_got, ops_want),
        *(tensors_apart(s_got[part], s_want[part]) for part in ("adapter", "optimizer")),
    )
    if (ops_got, s_got["adapter"], s_got["optimizer"]) != (
        ops_want,
        s_want["adapter"],
        s_want["optimizer"],
    ):
        diffs.append(f"not bit-identical (apart by {apart:.3g})")
    ledger, ref_ledger = ledger_of(r, got["run"]), ledger_of(r, want["run"])
    states = Counter(state for _, state in ledger["ops"].values())
    if set(states) - {"succeeded", "expired"}:  # expired: acknowledged, result released
        diffs.append(f"ledger states {dict(states)}")
    kinds = [Counter(k for k, _ in x["ops"].values()) for x in (ledger, ref_ledger)]
    if kinds[0] != kinds[1]:
        diffs.append(f"ledger operations by kind {dict(kinds[0])}, reference {dict(kinds[1])}")
    counted = (ledger["optim_steps"], s_got["optim_steps"], s_want["optim_steps"])
    if len(set(counted)) != 1:
        diffs.append(f"optimizer steps (ledger, trainer, reference): {counted}")
    if kind != "job" and s_got["optim_steps"] != got["steps"]:
        diffs.append(f"{s_got['optim_steps']} optimizer steps applied, {got['steps']} taken")
    # The trainer's own record: what it applied is in the ledger, and is the reference's.
    applied = {i for i in s_got["applied"] if i.rpartition("#")[2].isdigit()}
    if not applied <= set(ledger["ops"]):
        diffs.append(
            f"the trainer applied operations the ledger lacks: "
            f"{sorted(applied - set(ledger['ops']))}"
        )
    # The trainer keeps the newest ids it applied (its dedup window, max_applied_ops), a
    # restore's own id among them: once a run outgrows the window, the faulted run's holds
    # fewer seq_ids, and they must be the newest of the reference's.
    got_seqs, want_seqs = seqs(applied), seqs(set(s_want["applied"]))
    full = len(s_got["applied"]) == len(s_want["applied"])
    if got_seqs != want_seqs and not (full and got_seqs == want_seqs[-len(got_seqs) :]):
        diffs.append("the trainer applied other operations than the reference's")
    return diffs, apart


@pytest.mark.timeout(max(3600, 30 * FAULTS))  # 100 faults took 534-947 s
def test_fault_campaign_ends_where_a_fault_free_run_ends(make_fleet, sdk_python, tmp_path) -> None:
    python = sdk_python("0.38.0")
    holder: dict[str, Any] = {}
    proxies = {
        "gateway-controller": ResettingProxy(lambda: holder["fleet"].member("controller").port),
        "controller-trainer": ResettingProxy(lambda: holder["fleet"].member("trainer-0").port),
    }
    via_proxy = {name: f"127.0.0.1:{proxy.port}" for name, proxy in proxies.items()}
    extra_env = {
        "gateway": {"LORAFLEET_GATEWAY_CONTROLLER_ADDRESS": via_proxy["gateway-controller"]},
        "controller": ONE_PER_PASS,
        "trainer": {"LORAFLEET_TRAINER_SNAPSHOT_EVERY_STEPS": "4"},
        "trainer-0": {"LORAFLEET_TRAINER_ADVERTISE_ADDRESS": via_proxy["controller-trainer"]},
        "trainer-1": {"LORAFLEET_TRAINER_BASE_MODEL_NAME": CANARY_MODEL},
    }
    # Restarts at once and without end: the supervisor's growing backoff and budget are
    # tests/e2e/test_supervision.py's subject; here they would only stretch recoveries.
    fleet = make_fleet(
        trainers=2,
        slots=12,
        backoff_initial=0.2,
        backoff_max=1.0,
        restart_budget=10_000,
        extra_env=extra_env,
    )
    holder["fleet"] = fleet
    store = fleet.config.run_dir / "storage"
    try:
        with size_limited_store(store) as mounted, fleet:
            base = hub.served_name(fleet.config.model_path)

            def spec(phase: str, **more: object) -> dict[str, Any]:
                tenants = []
                for name, kind, loss, rank, seed in TENANTS:
                    key = fleet.create_api_key(f"campaign-{name}-{phase}", "campaign")
                    model = CANARY_MODEL if name == "canary" else base
                    tenants.append(
                        {
                            "name": name,
                            "kind": kind,
                            "loss": loss,
                            "rank": rank,
                            "seed": seed,
                            "api_key": key,
                            "base_model": model,
                            "params": JOB_PARAMS,
                            "pairs": JOB_PAIRS,
                        }
                    )
                return {"base_url": fleet.base_url, "tenants": tenants, **more}

            stop_file = tmp_path / "stop"
            runs: dict[str, str] = {}
            injector = Injector(
                fleet, proxies, store if mounted else None, runs, random.Random(SEED), FAULTS
            )

            def start_faults() -> None:
                def run() -> None:
                    injector.run()
                    stop_file.touch()

                threading.Thread(target=run, name="injector", daemon=True).start()

            started = time.monotonic()
            under_faults = spec("faults", stop_file=str(stop_file), min_steps=MIN_STEPS)
            times = run_tenants(
                python, under_faults, tmp_path / "faults.json", on_ready=start_faults, runs=runs
            )
            campaign_s = time.monotonic() - started
            assert injector.done.is_set() and injector.error is None, injector.error
            faulted = json.loads((tmp_path / "faults.json").read_text())
            left = {n: restore_points(store, r.get("run", "")) for n, r in faulted.items()}
            steps = {name: r["steps"] for name, r in faulted.items()}
            run_tenants(python, spec("reference", steps=steps), tmp_path / "reference.json")
            reference = json.loads((tmp_path / "reference.json").read_text())

            r = redis.Redis.from_url(fleet.redis_url)
            compared = {
                n: compare(fleet, r, n, k, faulted[n], reference[n]) for n, k, *_ in TENANTS
            }
            divergent = {name: d for name, (d, _) in compared.items() if d}
            recovered = recoveries(injector.log, times)
            by_kind: dict[str, float] = {}
            for (kind, _, _), took in zip(injector.log, recovered, strict=True):
                by_kind[kind] = round(max(took, by_kind.get(kind, 0.0)), 1)
            figures = {
                "faults": FAULTS,
                "seed": SEED,
                "by_kind": dict(Counter(kind for kind, _, _ in injector.log)),
                "disk_full": "tmpfs on the storage root" if mounted else "not available (no root)",
                "page_outs": dict(injector.pages),
                "steps": steps,
                "divergences": len(divergent),
                "divergent": divergent,
                "apart": {name: float(f"{a:.3g}") for name, (_, a) in compared.items()},
                "longest_recovery_s": round(max(recovered, default=0), 2),
                "longest_recovery_s_by_kind": by_kind,
                "campaign_s": round(campaign_s, 1),
                "restore_points_left": left,
            }
            if divergent:  # what happened when, to read beside the logs (seconds from start)
                t0 = injector.log[0][1] if injector.log else 0.0
                figures["fault_log"] = [
                    (k, round(a - t0, 1), round(b - t0, 1)) for k, a, b in injector.log
                ]
                figures["runs"] = {name: faulted[name].get("run") for name in faulted}
                figures["logs"] = str(fleet.config.run_dir / "logs")
            print(json.dumps(figures))
            assert not divergent, figures
    finally:
        for proxy in proxies.values():
            proxy.close()
