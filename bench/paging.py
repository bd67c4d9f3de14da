"""Paging: more concurrent clients than trainer slots, against rounds that fit the slots.

    .venv/bin/python bench/paging.py [--clients 40] [--slots 8] [--steps 10] [--think 0.5]
        [--page-idle 0.25] [--sdk]

Real processes: redis-server, the controller and one tiny-model trainer with `--slots` slots.
Each client owns one training run (its own LoRA seed and data) and does `--steps` steps
(forward_backward, then optim_step at the SDK's default AdamParams, each awaited as the SDK
does), pausing `--think` seconds after each step as a client that samples between steps does.
Three phases, side by side:

- `paged`: every client at once; the runs beyond the slots wait, and the controller pages idle
  runs out for them (LORAFLEET_CONTROLLER_PAGE_IDLE_SECONDS = `--page-idle`) and back in on
  their next step;
- `rounds`: `--clients / --slots` rounds of `--slots` clients, each round's runs deleted
  before the next (the schedule a fleet without paging needs: a finished run holds its slot);
- `alone`: each run by itself (no pauses: they change no result), the reference every run
  of the other phases must equal.

`--sdk` runs the same phases through the real SDK (tinker 0.38.0 from .venvs, one thread per
client, tests/e2e/paging_sdk_script.py) against a whole fleet, gateway included, and compares
the logprobs and losses the SDK returned.

Prints JSON: each phase's wall time, the paged/rounds time ratio, the page-out and page-in
durations the controller logged (p50/p99, count), and the largest difference of any run's
weights and Adam moments (`--sdk`: logprobs and losses) from its run alone (a step that
shared its forward/backward pass with other runs' rows may differ in the last bits; the step
counts must be equal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import torch
from safetensors.torch import load_file

from lorafleet.rpc.errors import from_rpc_error
from lorafleet.testing import child_env, free_port, start_redis, stop_process, wait_for_port
from lorafleet.v1 import common_pb2, controller_pb2, controller_pb2_grpc
from lorafleet_models.tiny import ensure_model

K = controller_pb2
TENANT = "bench"
REPO = Path(__file__).resolve().parents[1]


def tensor(values: list[Any], integer: bool) -> common_pb2.Tensor:
    fmt = f"<{len(values)}{'q' if integer else 'f'}"
    return common_pb2.Tensor(
        dtype=common_pb2.DTYPE_INT64 if integer else common_pb2.DTYPE_FLOAT32,
        shape=[len(values)],
        data=struct.pack(fmt, *values),
    )


def step_payloads(seed: int, step: int) -> list[controller_pb2.OperationPayload]:
    tokens = [(7 * step + 11 * seed + 5 * i) % 250 + 1 for i in range(16)]
    datum = common_pb2.Datum(
        tokens=tokens[:-1],
        loss_fn_inputs={
            "target_tokens": tensor(tokens[1:], True),
            "weights": tensor([1.0] * 15, False),
        },
    )
    fb = common_pb2.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    adam = common_pb2.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12)
    return [K.OperationPayload(forward_backward=fb), K.OperationPayload(optim_step=adam)]


class Controller:
    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.stub = controller_pb2_grpc.ControllerServiceStub(self.channel)

    async def __call__(self, method: str, request: Any, deadline: float = 60) -> Any:
        try:
            return await getattr(self.stub, method)(request, timeout=deadline)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc) from None


class Run:
    def __init__(self, c: Controller, rid: str, seed: int) -> None:
        self.c, self.rid, self.seed, self.seq = c, rid, seed, 0

    async def op(self, payload: controller_pb2.OperationPayload) -> None:
        self.seq += 1
        resp = await self.c(
            "SubmitOperation",
            K.SubmitOperationRequest(
                tenant=TENANT,
                registration_id=self.rid,
                seq_id=self.seq,
                payload=payload.SerializeToString(deterministic=True),
            ),
        )
        while True:
            got = await self.c(
                "GetOperation",
                K.GetOperationRequest(
                    tenant=TENANT, operation_id=resp.operation_id, wait_seconds=30
                ),
            )
            state = got.operation.state
            if state not in (K.OPERATION_STATE_QUEUED, K.OPERATION_STATE_CLAIMED):
                break
        if state != K.OPERATION_STATE_SUCCEEDED:
            raise RuntimeError(f"{self.rid} seq {self.seq}: {got.operation.error}")

    async def train(self, steps: int, think: float) -> None:
        for step in range(steps):
            for payload in step_payloads(self.seed, step):
                await self.op(payload)
            await asyncio.sleep(think)

    async def state(self, storage: Path) -> dict[str, Any]:
        name = f"final-{self.seq + 1}"
        await self.op(K.OperationPayload(save_state=K.SaveStatePayload(name=name)))
        folder = storage / self.rid / name
        steps = json.loads((folder / "trainer_state.json").read_text())["optim_steps"]
        tensors = {
            **load_file(folder / "adapter_model.safetensors"),
            **load_file(folder / "optimizer.safetensors"),
        }
        return {"steps": steps, "tensors": tensors}

    async def delete(self) -> None:
        req = K.DeleteRegistrationRequest(tenant=TENANT, registration_id=self.rid)
        await self.c("DeleteRegistration", req)


async def phase(
    c: Controller,
    session: str,
    base: str,
    seeds: list[int],
    first: int,
    steps: int,
    think: float,
    storage: Path,
) -> tuple[float, dict[int, dict[str, Any]]]:
    """Create one run per seed, train them all concurrently; (seconds, state per seed)."""
    start = time.perf_counter()
    runs = []
    for i, seed in enumerate(seeds):
        resp = await c(
            "CreateRegistration",
            K.CreateRegistrationRequest(
                tenant=TENANT,
                session_id=session,
                model_seq_id=first + i,
                base_model=base,
                lora_config=common_pb2.LoraConfig(
                    rank=8, seed=seed, train_attn=True, train_mlp=True
                ),
            ),
        )
        runs.append(Run(c, resp.registration.registration_id, seed))
    await asyncio.gather(*(run.train(steps, think) for run in runs))
    seconds = time.perf_counter() - start
    states = {run.seed: await run.state(storage) for run in runs}
    for run in runs:
        await run.delete()
    return seconds, states


async def heartbeat(c: Controller, session: str) -> None:
    """The SDK's session heartbeat (every 10 s): a silent session is finished."""
    while True:
        await c("SessionHeartbeat", K.SessionHeartbeatRequest(tenant=TENANT, session_id=session))
        await asyncio.sleep(10)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


def durations(log: str, what: str) -> dict[str, Any]:
    values = [float(x) for x in re.findall(rf"{what} \S+ .*?in ([0-9.]+)s", log)]
    return {
        "count": len(values),
        "p50_s": pct(values, 0.5),
        "p99_s": pct(values, 0.99),
        "mean_s": round(statistics.fmean(values), 4) if values else None,
    }


def max_diff(got: dict[int, dict[str, Any]], alone: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The largest absolute difference of any tensor from its run alone, where, and that
    tensor's largest magnitude; `rel`: the largest difference relative to its tensor's."""
    worst: dict[str, Any] = {"abs": 0.0}
    for seed, ref in alone.items():
        if got[seed]["steps"] != ref["steps"]:
            raise AssertionError(f"seed {seed}: {got[seed]['steps']} steps, {ref['steps']} alone")
        for key, t in ref["tensors"].items():
            diff = float((got[seed]["tensors"][key] - t).abs().max())
            if diff > worst["abs"]:
                worst = {"abs": diff, "seed": seed, "key": key, "max": float(t.abs().max())}
            worst["rel"] = max(worst.get("rel", 0.0), diff / max(float(t.abs().max()), 1e-30))
    return worst


async def bench(args: argparse.Namespace, port: int, storage: Path) -> dict[str, Any]:
    c = Controller(port)
    base = ""
    while not base:
        caps = await c("GetCapabilities", K.GetCapabilitiesRequest())
        base = next((m.name for m in caps.models if m.trainable), "")
        await asyncio.sleep(0.2)
    session = (await c("CreateSession", K.CreateSessionRequest(tenant=TENANT))).session_id
    beat = asyncio.ensure_future(heartbeat(c, session))
    seeds = list(range(1, args.clients + 1))
    steps, think = args.steps, args.think
    paged_s, paged = await phase(c, session, base, seeds, 0, steps, think, storage)
    rounds_s, rounds = 0.0, {}
    for r in range(0, args.clients, args.slots):
        group = seeds[r : r + args.slots]
        s, states = await phase(c, session, base, group, 1000 + r, steps, think, storage)
        rounds_s += s
        rounds.update(states)
    alone = {}  # pauses change no result: the references run without them
    for i, seed in enumerate(seeds):
        alone.update((await phase(c, session, base, [seed], 2000 + i, steps, 0, storage))[1])
    beat.cancel()
    return {
        "paged_s": round(paged_s, 2),
        "rounds_s": round(rounds_s, 2),
        "paged_over_rounds": round(paged_s / rounds_s, 3),
        "diff_paged_vs_alone": max_diff(paged, alone),
        "diff_rounds_vs_alone": max_diff(rounds, alone),
        "diff_paged_vs_rounds": max_diff(paged, rounds),
    }


def flat(values: Any) -> list[float]:
    if isinstance(values, list):
        return [x for v in values for x in flat(v)]
    return [float(values)] if values is not None else []


def sdk_diff(got: dict[str, Any], alone: dict[str, Any]) -> float:
    """The largest difference of any logprob or loss the SDK returned from the run alone."""
    worst = 0.0
    for seed, ref in alone.items():
        a, b = flat(got[seed]), flat(ref)
        if len(a) != len(b):
            raise AssertionError(f"seed {seed}: {len(a)} values, {len(b)} alone")
        worst = max([worst, *(abs(x - y) for x, y in zip(a, b, strict=True))])
    return worst


def sdk_bench(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """The same phases through the real SDK (tinker 0.38.0) and the whole fleet (gateway
    included): tests/e2e/paging_sdk_script.py runs the clients, one thread each."""
    import httpx

    from lorafleet_cli.fleet import Fleet, FleetConfig

    python = REPO / ".venvs" / "tinker-0.38.0" / "bin" / "python"
    script = REPO / "tests" / "e2e" / "paging_sdk_script.py"
    env = {
        "controller": {
            "LORAFLEET_CONTROLLER_PAGE_IDLE_SECONDS": str(args.page_idle),
            "LORAFLEET_CONTROLLER_SWEEP_INTERVAL_SECONDS": "0.1",
        }
    }
    seeds = list(range(1, args.clients + 1))
    with tempfile.TemporaryDirectory() as tmp:
        config = FleetConfig(model_path=model, run_dir=Path(tmp), slots=args.slots, extra_env=env)
        with Fleet(config) as fleet:
            caps = httpx.get(
                f"{fleet.base_url}/api/v1/get_server_capabilities",
                headers={"X-API-Key": fleet.api_key},
                timeout=60,
            ).json()

            def sdk(group: list[int], mode: str) -> dict[str, Any]:
                proc = subprocess.run(
                    [str(python), str(script)],
                    env=child_env(
                        TINKER_BASE_URL=fleet.base_url,
                        TINKER_API_KEY=fleet.api_key,
                        SMOKE_BASE_MODEL=caps["supported_models"][0]["model_name"],
                        PAGING_SEEDS=",".join(map(str, group)),
                        PAGING_STEPS=str(args.steps),
                        PAGING_PAUSE=str(args.think),
                        PAGING_MODE=mode,
                    ),
                    capture_output=True,
                    text=True,
                    check=False,
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if proc.returncode or not lines:
                    raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-4000:])
                out = json.loads(lines[-1][len("RESULT ") :])
                if out["errors"]:
                    raise RuntimeError(out["errors"])
                return out

            paged = sdk(seeds, "together")
            rounds = [
                sdk(seeds[r : r + args.slots], "together")
                for r in range(0, args.clients, args.slots)
            ]
            alone = sdk(seeds, "alone")["alone"]
            log = (config.run_dir / "logs" / "controller.log").read_text()
    rounds_s = sum(r["shared_s"] for r in rounds)
    rounds_shared = {k: v for r in rounds for k, v in r["shared"].items()}
    return {
        "paged_s": round(paged["shared_s"], 2),
        "rounds_s": round(rounds_s, 2),
        "paged_over_rounds": round(paged["shared_s"] / rounds_s, 3),
        "max_abs_diff_paged_vs_alone": sdk_diff(paged["shared"], alone),
        "max_abs_diff_rounds_vs_alone": sdk_diff(rounds_shared, alone),
        "page_out": durations(log, "paged out"),
        "page_in": durations(log, "paged in"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=40)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--think", type=float, default=0.5)
    p.add_argument("--page-idle", type=float, default=0.25)
    p.add_argument("--sdk", action="store_true", help="through the real SDK and the gateway")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = ensure_model("tiny", REPO / ".cache" / "models")
    if args.sdk:
        print(json.dumps({"config": vars(args), **sdk_bench(args, model)}, indent=2))
        return
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        redis = start_redis(root / "redis")
        cport, tport = free_port(), free_port()
        storage = root / "trainer-states"
        procs = []
        try:
            env = child_env(
                LORAFLEET_CONTROLLER_REDIS_URL=redis.url,
                LORAFLEET_CONTROLLER_PORT=str(cport),
                LORAFLEET_CONTROLLER_STORAGE_ROOT=str(root / "controller-storage"),
                LORAFLEET_CONTROLLER_SWEEP_INTERVAL_SECONDS="0.1",
                LORAFLEET_CONTROLLER_PAGE_IDLE_SECONDS=str(args.page_idle),
            )
            clog = (root / "controller.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "lorafleet_controller"],
                    env=env,
                    stdout=clog,
                    stderr=clog,
                )
            )
            wait_for_port(cport, proc=procs[0])
            env = child_env(
                LORAFLEET_TRAINER_MODEL_PATH=str(model),
                LORAFLEET_TRAINER_PORT=str(tport),
                LORAFLEET_TRAINER_NUM_SLOTS=str(args.slots),
                LORAFLEET_TRAINER_STORAGE_ROOT=str(storage),
                LORAFLEET_TRAINER_REPLICA_ID="trainer-0",
                LORAFLEET_TRAINER_CONTROLLER_ADDRESS=f"127.0.0.1:{cport}",
                LORAFLEET_TRAINER_REGISTER_INTERVAL_SECONDS="0.5",
                LORAFLEET_TRAINER_TORCH_THREADS="1",
            )
            tlog = (root / "trainer.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "lorafleet_trainer"], env=env, stdout=tlog, stderr=tlog
                )
            )
            wait_for_port(tport, proc=procs[1])
            out = asyncio.run(bench(args, cport, storage))
            log = (root / "controller.log").read_text()
            out = {
                "config": vars(args),
                **out,
                "page_out": durations(log, "paged out"),
                "page_in": durations(log, "paged in"),
            }
        finally:
            for proc in reversed(procs):
                stop_process(proc, grace=5)
            redis.stop()
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
