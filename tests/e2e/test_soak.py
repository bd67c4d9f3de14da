"""Nothing grows forever (issue 36 item 4): tenants cycle through sessions, runs, steps,
samples, checkpoints and deletes through the real SDK (tinker 0.38.0) for SOAK_MINUTES (CI: 5;
`SOAK_MINUTES=240` by hand), in PHASES. After each phase the test waits until every retention
queue of the fleet is empty (retired runs, finished sessions, versions let go, folders to
reclaim, results to expire) and reads the fleet's Redis (its keys' bytes, the key count)
and its disk (every file under the fleet's folder but the logs and Redis's own). Each level
must level off: what it grew over the last third of the phases is at most 5 % of what it grew
over the first. And every tenant's every cycle returns what one cycle run alone returned.

Reading drained levels, not levels mid-flight: a reading mid-flight lands anywhere in the
tenants' cycles, whose own keys and files come and go, and how many are in flight follows
how fast the machine runs; a drained level is what stays, which is what must not grow.
The retentions are the defaults shortened so that a cycle's leftovers go within the run:
finished sessions and retired runs are forgotten a second after, results after 20 s, removed
files at once. Every default is the same code with a longer wait.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from lorafleet.testing import child_env, wait_until

SCRIPT = Path(__file__).with_name("soak_sdk_script.py")
MINUTES = float(os.environ.get("SOAK_MINUTES", "5"))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(MINUTES * 60 + 1800)]
TENANTS = 3
PHASES = 9
GROWTH = 0.05  # the last third may grow this fraction of the first third's growth
LOGPROB_TOLERANCE = 1e-4  # samples share decode batches with other tenants' (rounding)
#: Key families that hold what waits for a retention: drained when none of them exists.
QUEUES = ("runs_retired", "sessions_finished", "versions_unheld", "reclaim", "retired", "results")
DRAIN_SECONDS = 600.0
RETENTIONS = {
    "LORAFLEET_CONTROLLER_FINISHED_SESSION_RETENTION_SECONDS": "1",
    "LORAFLEET_CONTROLLER_RETIRED_RUN_RETENTION_SECONDS": "1",
    "LORAFLEET_CONTROLLER_RESULT_TTL_SECONDS": "20",
    "LORAFLEET_CONTROLLER_CHECKPOINT_RECLAIM_GRACE_SECONDS": "0",
    # every operation alone in its trainer pass: a run's results do not depend on its
    # co-tenants' (bit-identical to the run alone; README, max_batch_operations)
    "LORAFLEET_CONTROLLER_MAX_BATCH_OPERATIONS": "1",
}


def files(root: Path) -> dict[Path, int]:
    """Every file under the fleet's folder but logs and Redis's own files (its memory is read
    from INFO; its append-only file is rewritten by Redis itself), with its size. A file the
    fleet removes while we look is not there."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = Path(folder, name)
            if name.endswith(".log") or path.relative_to(root).parts[0].startswith("redis"):
                continue
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                out[path] = st.st_size
    return out


def key_bytes(client: redis.Redis) -> Counter[str]:
    """What each key family's keys take in Redis (MEMORY USAGE, every element counted)."""
    out: Counter[str] = Counter()
    for key in client.scan_iter(count=1000):
        out[family(key)] += int(client.memory_usage(key, samples=0) or 0)
    return out


def levels(client: redis.Redis, root: Path) -> dict[str, float]:
    """Bytes the fleet's keys take (the dataset: Redis's own buffers and caches, which
    move with its clients and scripts, are not the fleet's), the key count, disk bytes."""
    return {
        "key_bytes": float(sum(key_bytes(client).values())),
        "keys": float(client.dbsize()),
        "disk": float(sum(files(root).values())),
    }


def family(key: bytes) -> str:
    """`{prefix|g0}:op:<id>` -> `op`."""
    return key.decode().split("}:", 1)[-1].split(":", 1)[0]


def drained(client: redis.Redis) -> bool:
    return not any(family(k) in QUEUES for k in client.scan_iter(count=1000))


def census(client: redis.Redis, root: Path) -> dict[str, dict[str, int]]:
    """Keys by family (`{prefix|g0}:op:<id>` counts as `op`) and files by folder, two levels
    deep: where a level that grew went (printed with the figures)."""
    keys = Counter(family(k) for k in client.scan_iter(count=1000))
    folders = Counter("/".join(p.relative_to(root).parts[:2]) for p in files(root))
    return {"keys": dict(keys), "key_bytes": dict(key_bytes(client)), "files": dict(folders)}


def growths(series: list[float], start: float) -> tuple[float, float]:
    """(first third's growth, last third's growth) of a drained level read after each
    phase."""
    third = len(series) // 3
    return series[third - 1] - start, series[-1] - series[2 * third - 1]


class Script:
    """The SDK script, its output in files (a pipe nobody reads until it exits fills up and
    blocks the script: the RESULT line alone holds every cycle's logprobs)."""

    def __init__(
        self, python: Path, env: dict[str, str], keys: list[str], seconds: float, out: Path
    ):
        self.out, self.err = out.with_suffix(".out"), out.with_suffix(".err")
        with self.out.open("w") as stdout, self.err.open("w") as stderr:
            self.proc = subprocess.Popen(
                [str(python), str(SCRIPT)],
                env={**env, "SOAK_KEYS": json.dumps(keys), "SOAK_SECONDS": str(seconds)},
                stdout=stdout,
                stderr=stderr,
            )

    def result(self, timeout: float) -> list[dict[str, Any]]:
        self.proc.wait(timeout=timeout)
        out, err = self.out.read_text(), self.err.read_text()
        assert self.proc.returncode == 0, out[-3000:] + err[-6000:]
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, out[-3000:] + err[-6000:]
        return list(json.loads(lines[-1][len("RESULT ") :]))


def same(cycle: dict[str, Any], alone: dict[str, Any]) -> bool:
    if cycle["losses"] != alone["losses"]:
        return False
    for got, want in zip(cycle["samples"], alone["samples"], strict=True):
        if got["tokens"] != want["tokens"]:
            return False
        pairs = zip(got["logprobs"], want["logprobs"], strict=True)
        if any(abs(a - b) > LOGPROB_TOLERANCE for a, b in pairs):
            return False
    return True


def test_a_fleet_cycling_tenants_levels_off(
    make_fleet: Any, sdk_python: Any, tmp_path: Path
) -> None:
    python = sdk_python("0.38.0")
    with make_fleet(slots=4, extra_env={"controller": RETENTIONS}) as fleet:
        model = httpx.get(
            f"{fleet.base_url}/api/v1/get_server_capabilities",
            headers={"X-API-Key": fleet.api_key},
            timeout=60,
        ).json()["supported_models"][0]["model_name"]
        env = child_env(TINKER_BASE_URL=fleet.base_url, SMOKE_BASE_MODEL=model)
        env.pop("TINKER_API_KEY", None)  # each client names its own tenant's key
        alone_key = fleet.create_api_key("alone", "soak")
        (reference,) = Script(python, env, [alone_key], 0, tmp_path / "alone").result(900)
        assert reference["errors"] == [] and len(reference["cycles"]) == 1
        alone = reference["cycles"][0]

        client = redis.Redis.from_url(fleet.redis_url)
        root = Path(fleet.config.run_dir)
        wait_until(lambda: drained(client), "the reference's leftovers gone", DRAIN_SECONDS)
        keys = [fleet.create_api_key(f"soak-{i}", "soak") for i in range(TENANTS)]
        start, before = levels(client, root), census(client, root)
        series: list[dict[str, float]] = []
        tenants: list[dict[str, Any]] = [{"cycles": [], "errors": []} for _ in keys]
        for phase in range(PHASES):
            out = tmp_path / f"phase-{phase}"
            ran = Script(python, env, keys, MINUTES * 60 / PHASES, out).result(MINUTES * 60 + 900)
            for mine, got in zip(tenants, ran, strict=True):
                mine["cycles"] += got["cycles"]
                mine["errors"] += got["errors"]
            wait_until(lambda: drained(client), f"phase {phase}'s leftovers gone", DRAIN_SECONDS)
            series.append(levels(client, root))
        after = census(client, root)

        report = {}
        for name in start:
            first, last = growths([s[name] for s in series], start[name])
            report[name] = {"first": first, "last": last}
        print("SOAK", json.dumps({"minutes": MINUTES, "levels": [start, *series], **report}))
        print("CENSUS", json.dumps({"before": before, "after": after}))
        cycles = [c for t in tenants for c in t["cycles"]]
        assert [t["errors"] for t in tenants] == [[]] * TENANTS
        assert all(len(t["cycles"]) >= PHASES for t in tenants), [len(t["cycles"]) for t in tenants]
        different = [i for i, c in enumerate(cycles) if not same(c, alone)]
        assert different == [], (different, alone, [cycles[i] for i in different[:2]])
        for name, growth in report.items():
            assert growth["last"] <= GROWTH * max(growth["first"], 0.0), (name, report)
        assert after["files"] == before["files"], (before, after)  # nothing left on disk
