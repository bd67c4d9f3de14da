"""Trainer groups (torch.distributed, gloo on CPU): two ranks equal one process.

The group runs `group_scenario.py` as two real rank processes (the launcher's environment
variables, as torchrun sets them); the reference runs the same scenario in this process on
a plain TrainerEngine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from lorafleet.testing import free_port, stop_process

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("group_scenario", HERE / "group_scenario.py")
group_scenario = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(group_scenario)
TOL = 1e-5


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(
        (got - want).abs().max() <= TOL * max(1.0, float(want.abs().max()))
    )


def launch_ranks(argv: list[str], world: int, log_dir: Path) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        log = (log_dir / f"rank{rank}.log").open("w")
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float, log_dir: Path) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            stop_process(p, grace=2.0)
        logs = "\n".join(f.read_text()[-2000:] for f in sorted(log_dir.glob("rank*.log")))
        raise AssertionError(f"the group did not finish in {timeout} s:\n{logs}") from None


def assert_same_state(got: dict, want: dict) -> None:
    for slot in want:
        assert got[slot]["steps"] == want[slot]["steps"]
        for g, w in zip(got[slot]["weights"], want[slot]["weights"], strict=True):
            assert close(g, w)
        assert got[slot]["moments"].keys() == want[slot]["moments"].keys()
        for i, (m, v) in want[slot]["moments"].items():
            assert close(got[slot]["moments"][i][0], m)
            assert close(got[slot]["moments"][i][1], v)


def test_two_ranks_equal_one_process_and_resume_in_one(tiny_model_dir, engine_for, tmp_path):
    storage, out = tmp_path / "group-states", tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, str(HERE / "group_scenario.py"), str(tiny_model_dir), str(storage)]
    procs = launch_ranks([*argv, str(out)], 2, out)
    codes = wait_all(procs, 600, out)
    logs = "\n".join(f.read_text()[-2000:] for f in sorted(out.glob("rank*.log")))
    assert codes == [0, 0], logs

    # Each rank holds about half of the base at rest.
    fractions = [json.loads((out / f"fraction-{r}.json").read_text())["fraction"] for r in (0, 1)]
    assert all(f <= 0.6 for f in fractions), fractions
    assert abs(sum(fractions) - 1.0) < 0.01, fractions

    group = torch.load(out / "record.pt", weights_only=False)
    single = engine_for(tiny_model_dir)
    want = group_scenario.run(single)
    for got_step, want_step in zip(group["logprobs"], want["logprobs"], strict=True):
        for g, w in zip(got_step, want_step, strict=True):
            assert close(g, w)
    for got_step, want_step in zip(group["grads"], want["grads"], strict=True):
        assert got_step.keys() == want_step.keys()
        for key in want_step:
            assert close(got_step[key], want_step[key]), key
    assert_same_state(group["state"], want["state"])

    # The group's saved state resumes in one process and continues like the uninterrupted run.
    resumed = engine_for(tiny_model_dir, storage_root=storage)
    for slot, spec in group_scenario.SPECS.items():
        resumed.bind(slot, f"r{slot}", spec)
        resumed.load_state("load", slot, f"r{slot}", group["refs"][slot], True)
    steps = group_scenario.STEPS
    after = group_scenario.train(resumed, steps, steps + 1)
    cont = group_scenario.train(single, steps, steps + 1)
    for g, w in zip(after["logprobs"][0], cont["logprobs"][0], strict=True):
        assert close(g, w)
    assert_same_state(after["state"], cont["state"])
