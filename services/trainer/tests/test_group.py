"""Trainer groups (torch.distributed, gloo on CPU): two data-parallel ranks equal one process.

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

import pytest
import torch

from lorafleet.testing import free_port, payload_bytes, stop_process
from lorafleet_trainer.group import launcher_env

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("group_scenario", HERE / "group_scenario.py")
group_scenario = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(group_scenario)
TOL = 1e-5


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool(
        (got - want).abs().max() <= TOL * max(1.0, float(want.abs().max()))
    )


@pytest.fixture(autouse=True)
def one_thread():
    """The in-process reference computes on one thread, as each rank does: a GEMM split over
    two threads sums in another order, and three AdamW steps (which divide by the square root
    of tiny second moments) grow that rounding past the tolerance (3e-5 on the weights here
    with torch's default two threads; 0.0 with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def launch_ranks(
    argv: list[str], world: int, log_dir: Path, base_env: dict[str, str] | None = None
) -> list[subprocess.Popen]:
    """One process per rank with the variables torchrun would set; logs in log_dir."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **(base_env or os.environ),
            **launcher_env(rank, world, port),
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


@pytest.mark.parametrize("model", ["tiny", "tiny-moe"])
def test_two_ranks_equal_one_process_and_resume_in_one(model, request, engine_for, tmp_path):
    """On the dense tiny model and on the MoE one (per-expert LoRA on sharded expert banks)."""
    tiny_model_dir = request.getfixturevalue(
        "tiny_model_dir" if model == "tiny" else "moe_model_dir"
    )
    storage, out = tmp_path / "group-states", tmp_path / "out"
    out.mkdir()
    argv = [sys.executable, str(HERE / "group_scenario.py"), str(tiny_model_dir), str(storage)]
    procs = launch_ranks([*argv, str(out)], 2, out)
    codes = wait_all(procs, 600, out)
    logs = "\n".join(f.read_text()[-2000:] for f in sorted(out.glob("rank*.log")))
    assert codes == [0, 0], logs

    # Each rank holds about half of the base at rest, and computes only its share of the rows.
    shares = [json.loads((out / f"share-{r}.json").read_text()) for r in (0, 1)]
    fractions = [s["fraction"] for s in shares]
    assert all(f <= 0.6 for f in fractions), fractions
    assert abs(sum(fractions) - 1.0) < 0.01, fractions
    batch = (group_scenario.STEPS + 1) * group_scenario.batch_tokens()  # and the vetoed step
    forward = [s["forward_tokens"] for s in shares]
    assert all(f <= 0.6 * batch for f in forward), (forward, batch)
    assert sum(forward) == batch, (forward, batch)  # every row once, on one rank

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
    # A non-finite gradient on rank 1's rows vetoes that slot's step on every rank, as in
    # one process: its weights, moments and step count stay exactly as they were.
    assert (
        group["veto"]["applied"] == want["veto"]["applied"] == {0: True, 1: True, 2: True, 3: False}
    )
    assert_same_state({3: group["veto"]["state"][3]}, {3: group["veto"]["before"]})
    assert_same_state(group["veto"]["state"], want["veto"]["state"])
    assert group["refused_import"] == want["refused_import"] == "R_MISMATCH"  # rank 8 vs 4

    # The group's saved state resumes in one process and continues like the uninterrupted run.
    resumed = engine_for(tiny_model_dir, storage_root=storage)
    after = group_scenario.resume(resumed, group["refs"])
    steps = group_scenario.STEPS
    cont = group_scenario.train(single, steps, steps + 1)
    for g, w in zip(after["logprobs"][0], cont["logprobs"][0], strict=True):
        assert close(g, w)
    assert_same_state(after["state"], cont["state"])


def test_one_process_state_resumes_in_a_group(tiny_model_dir, engine_for, tmp_path) -> None:
    storage, out = tmp_path / "states", tmp_path / "out"
    out.mkdir()
    single = engine_for(tiny_model_dir, storage_root=storage)
    refs = group_scenario.run(single)["refs"]
    torch.save(refs, tmp_path / "refs.pt")
    argv = [sys.executable, str(HERE / "group_scenario.py"), str(tiny_model_dir), str(storage)]
    procs = launch_ranks([*argv, str(out), str(tmp_path / "refs.pt")], 2, out)
    codes = wait_all(procs, 600, out)
    logs = "\n".join(f.read_text()[-2000:] for f in sorted(out.glob("rank*.log")))
    assert codes == [0, 0], logs
    group = torch.load(out / "record.pt", weights_only=False)
    steps = group_scenario.STEPS
    cont = group_scenario.train(single, steps, steps + 1)
    for g, w in zip(group["logprobs"][0], cont["logprobs"][0], strict=True):
        assert close(g, w)
    for key, w in cont["grads"][0].items():
        assert close(group["grads"][0][key], w), key
    assert_same_state(group["state"], cont["state"])


def _service_env(port: int, model_dir: Path, tmp_path: Path) -> dict[str, str]:
    """Rank 0 may drain for 5 minutes after SIGTERM: a loaded machine must not cut a step."""
    from lorafleet.testing import child_env

    return child_env(
        LORAFLEET_TRAINER_PORT=str(port),
        LORAFLEET_TRAINER_MODEL_PATH=str(model_dir),
        LORAFLEET_TRAINER_NUM_SLOTS="2",
        LORAFLEET_TRAINER_MAX_RANK="8",
        LORAFLEET_TRAINER_STORAGE_ROOT=str(tmp_path / "states"),
        LORAFLEET_TRAINER_TORCH_THREADS="1",
        LORAFLEET_TRAINER_GROUP_TIMEOUT_SECONDS="30",
        LORAFLEET_TRAINER_GROUP_KEEPALIVE_SECONDS="1",
        LORAFLEET_TRAINER_GRACE_SECONDS="300",
    )


async def _serving_stub(channel):
    """The group's TrainerService stub once rank 0 serves, with slot 0 bound to "r"."""
    from lorafleet.testing import wait_serving
    from lorafleet.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

    await wait_serving(channel, "lorafleet.v1.TrainerService", within=120)
    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
    cfg = common_pb2.LoraConfig(rank=4, seed=3, train_attn=True, train_mlp=True)
    await stub.BindSlot(
        trainer_pb2.BindSlotRequest(slot=0, registration_id="r", lora_config=cfg), timeout=60
    )
    await stub.ForwardBackward(_request("warm", 1), timeout=60)  # the group serves
    return stub


def _request(op: str, rows: int):
    """A cross-entropy ForwardBackward of `rows` random 256-token datums on slot 0."""
    from lorafleet.v1 import common_pb2, trainer_pb2
    from lorafleet_trainer import convert

    gen = torch.Generator().manual_seed(rows)
    data = [
        common_pb2.Datum(
            tokens=torch.randint(0, 2048, (256,), generator=gen).tolist(),
            loss_fn_inputs={
                "target_tokens": convert.tensor_to_proto(
                    torch.randint(0, 2048, (256,), generator=gen)
                ),
                "weights": convert.tensor_to_proto(torch.ones(256)),
            },
        )
        for _ in range(rows)
    ]
    item = trainer_pb2.ForwardBackwardItem(
        operation_id=op,
        slot=0,
        registration_id="r",
        payload=payload_bytes(common_pb2.ForwardBackwardInput(data=data, loss_fn="cross_entropy")),
    )
    return trainer_pb2.ForwardBackwardRequest(items=[item])


def _start_service_group(model_dir: Path, tmp_path: Path) -> tuple[int, list[subprocess.Popen]]:
    from lorafleet.testing import wait_for_port

    port = free_port()
    argv = [sys.executable, "-m", "lorafleet_trainer"]
    procs = launch_ranks(argv, 2, tmp_path, _service_env(port, model_dir, tmp_path))
    try:
        wait_for_port(port, timeout=120, proc=procs[0])
    except BaseException:
        for p in procs:
            stop_process(p, grace=2.0)
        raise
    return port, procs


async def test_rank_killed_mid_step_takes_the_replica_down(tiny_model_dir, tmp_path) -> None:
    """SIGKILL rank 1 during a forward_backward: the call fails and rank 0 exits (status 3)
    well within the controller's heartbeat window, instead of hanging in a collective."""
    import asyncio
    import signal

    import grpc

    port, procs = _start_service_group(tiny_model_dir, tmp_path)
    rank0, rank1 = procs
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = await _serving_stub(channel)
            call = asyncio.ensure_future(stub.ForwardBackward(_request("big", 48), timeout=120))
            await asyncio.sleep(0.5)
            rank1.send_signal(signal.SIGKILL)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call  # rank 0 exits rather than answer from a broken group
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        loop = asyncio.get_running_loop()
        code = await loop.run_in_executor(None, lambda: rank0.wait(timeout=60))
        assert code == 3, (tmp_path / "rank0.log").read_text()[-3000:]
        assert "trainer group lost" in (tmp_path / "rank0.log").read_text()
    finally:
        for p in procs:
            stop_process(p, grace=2.0)


async def test_sigterm_to_every_rank_drains_and_exits_cleanly(tiny_model_dir, tmp_path) -> None:
    """As torchrun and Kubernetes do: SIGTERM to all ranks while a step runs. Rank 0 drains
    (the step completes with the other rank's help), releases it, and both exit 0."""
    import asyncio
    import signal

    import grpc

    port, procs = _start_service_group(tiny_model_dir, tmp_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = await _serving_stub(channel)
            call = asyncio.ensure_future(stub.ForwardBackward(_request("big", 8), timeout=300))
            await asyncio.sleep(0.5)
            for p in procs:
                p.send_signal(signal.SIGTERM)
            reply = await call
            assert not reply.results[0].HasField("error"), reply
        loop = asyncio.get_running_loop()
        codes = await loop.run_in_executor(None, lambda: [p.wait(timeout=300) for p in procs])
        logs = [(tmp_path / f"rank{r}.log").read_text()[-2000:] for r in (0, 1)]
        assert codes == [0, 0], logs
    finally:
        for p in procs:
            stop_process(p, grace=2.0)
