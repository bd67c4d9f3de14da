"""Trainer groups: step time and memory per rank, world sizes 1 and 2, on the ~20M model.

Each world size runs as real rank processes (the variables torchrun sets, gloo) through the
distributed path (`load_group_engine`, FSDP2, `GroupEngine`), one after the other, with the
same total torch threads (`--threads`, default 2: one process of 2 threads against two
ranks of 1). Each rank computes its share of the batch's rows (data parallel, see
lorafleet_trainer.group), so the step time of world 2 should match world 1's. Per rank: the
base bytes it holds at rest (its FSDP shards), its RSS, and its peak RSS during the steps
(the kernel's high-water mark, reset once the model is loaded and sharded, so the full
checkpoint every rank reads first is not counted), also less the RSS of the bare runtime
(python, torch, transformers: ~the same for every rank), and its RSS at rest after the
steps, less the runtime.

    python bench/trainer_group.py [--steps N] [--batch ROWS] [--seq TOKENS] [--threads T]
        [--rounds R] [--reshard auto|true|false]   # defaults 5, 8, 128, 2, 1, auto
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from trainer_step import bench_model_dir

from lorafleet.testing import free_port
from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)
from lorafleet_trainer.group import launcher_env

RANK = 8


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field}")


def reset_peak() -> None:
    """Give freed heap back, then restart the peak-RSS high-water mark (Linux clear_refs 5)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")


def rank_main(
    model_dir: Path, steps: int, batch: int, seq: int, threads: int, reshard: str, out: Path
) -> None:
    import transformers.models.llama.modeling_llama  # noqa: F401  (the runtime, before the model)

    from lorafleet_trainer.group import (
        GroupEngine,
        GroupEnv,
        load_group_engine,
        local_fraction,
        worker_loop,
    )

    torch.set_num_threads(threads)
    env = GroupEnv.from_environ()
    runtime_mib = status_kib("VmRSS") / 1024
    with tempfile.TemporaryDirectory() as storage:
        engine, group = load_group_engine(
            model_dir,
            env,
            device="cpu",
            dtype="float32",
            timeout=600.0,
            base_model="bench",
            reshard=reshard,
            num_slots=1,
            max_rank=RANK,
            storage_root=Path(storage),
        )
        base_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        held = local_fraction(engine.model)
        reset_peak()
        record = {
            "rank": env.rank,
            "base_fraction_held": held,
            "base_mib_held": held * base_bytes / 2**20,
        }
        if env.rank != 0:
            worker_loop(engine, group)
        else:
            driver = GroupEngine(engine, group, keepalive=5.0, on_lost=lambda exc: os._exit(3))
            driver.bind(0, "r0", LoraSpec(rank=RANK, seed=1))
            gen = torch.Generator().manual_seed(0)
            times = []
            for step in range(steps + 1):  # step 0 warms up
                data = [
                    Datum(
                        torch.randint(0, 2048, (seq,), generator=gen).tolist(),
                        {
                            "target_tokens": torch.randint(0, 2048, (seq,), generator=gen),
                            "weights": torch.ones(seq),
                        },
                    )
                    for _ in range(batch)
                ]
                item = ForwardBackwardItem(
                    f"fb{step}", 0, "r0", ForwardBackwardInput(data, "cross_entropy")
                )
                start = time.perf_counter()
                driver.forward_backward([item])
                driver.optim_step(f"s{step}", 0, "r0", AdamParams(learning_rate=1e-4))
                if step:
                    times.append(time.perf_counter() - start)
            record["step_seconds"] = sorted(times)[len(times) // 2]
            driver.close()
        record["peak_rss_mib"] = status_kib("VmHWM") / 1024
        record["peak_above_runtime_mib"] = record["peak_rss_mib"] - runtime_mib
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        record["rest_above_runtime_mib"] = status_kib("VmRSS") / 1024 - runtime_mib
        (out / f"rank{env.rank}.json").write_text(json.dumps(record))
        group.close()


def run_world(model_dir: Path, world: int, args: argparse.Namespace) -> list[dict]:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                **launcher_env(rank, world, port),
                "OMP_NUM_THREADS": str(args.threads // world),
                # One heap arena and mmap for large blocks: freed tensors leave the RSS, so
                # it shows live memory rather than what glibc kept (gloo adds threads/arenas).
                "MALLOC_ARENA_MAX": "1",
                "MALLOC_MMAP_THRESHOLD_": "65536",
            }
            argv = [sys.executable, __file__, "--rank-of", str(model_dir), "--out", str(out)]
            sizes = ["--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq)]
            sizes += ["--threads", str(args.threads // world), "--reshard", args.reshard]
            procs.append(subprocess.Popen([*argv, *sizes], env=env))
        codes = [p.wait(timeout=1800) for p in procs]
        if codes != [0] * world:
            raise SystemExit(f"world size {world}: ranks exited {codes}")
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="world 1 and 2 runs, alternated")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of all ranks")
    parser.add_argument(
        "--reshard",
        choices=("auto", "true", "false"),
        default="auto",
        help="LORAFLEET_TRAINER_GROUP_RESHARD_AFTER_FORWARD for the ranks (auto: false on CPU)",
    )
    parser.add_argument("--rank-of", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        rank_main(
            args.rank_of, args.steps, args.batch, args.seq, args.threads, args.reshard, args.out
        )
        return
    model_dir, name = bench_model_dir()
    # Rounds alternate which world size runs first, so a machine whose load changes between
    # the two runs tilts the rounds both ways; the ratio reported is the median round's.
    ratios, one, two = [], [], []
    for round_ in range(args.rounds):
        worlds = (1, 2) if round_ % 2 == 0 else (2, 1)
        runs = {w: run_world(model_dir, w, args) for w in worlds}
        one, two = runs[1], runs[2]
        ratios.append(two[0]["step_seconds"] / one[0]["step_seconds"])
    r1 = one[0]
    result = {
        "model": name,
        "batch": f"{args.batch}x{args.seq}",
        "steps": args.steps,
        "total_threads": args.threads,
        "reshard_after_forward": args.reshard,
        "world_1": one,
        "world_2": two,
        "base_held_ratio_2_over_1": max(r["base_mib_held"] for r in two) / r1["base_mib_held"],
        "peak_rss_ratio_2_over_1": max(r["peak_rss_mib"] for r in two) / r1["peak_rss_mib"],
        "peak_above_runtime_ratio_2_over_1": max(r["peak_above_runtime_mib"] for r in two)
        / r1["peak_above_runtime_mib"],
        "rest_above_runtime_ratio_2_over_1": max(r["rest_above_runtime_mib"] for r in two)
        / r1["rest_above_runtime_mib"],
        "step_time_ratio_2_over_1_per_round": ratios,
        "step_time_ratio_2_over_1": statistics.median(ratios),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
