"""SFT through the real tinker SDK + lorafleet vs the same loop in-process with PEFT.

    .venv/bin/python bench/sdk_loop.py [--steps 8] [--batch 8] [--seq 128] [--rank 8]

Needs the SDK venv (tests/sdk/setup_venvs.sh). Builds the ~20M "bench" model, starts a fleet
(Redis, controller, one trainer, gateway) on loopback, runs forward_backward + optim_step
steps through tinker 0.38 in its own process, and the same steps in this process with
transformers + PEFT (same model, rank, batch, AdamW) before and after the fleet run, which
brackets it against load drift. Prints one JSON object: median step
seconds for both, their ratio, and where the fleet's time goes (SDK submit vs wait, gateway
time per route from its Prometheus histogram). Both runs happen in this one invocation, side
by side, so the ratio is meaningful on a noisy machine; absolute numbers are not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
SDK_PYTHON = REPO / ".venvs" / "tinker-0.38.0" / "bin" / "python"

SDK_SCRIPT = r"""
import json, os, sys, time
import numpy as np
import tinker
from tinker import types
steps, batch, seq, rank = map(int, sys.argv[1:5])
rng = np.random.default_rng(0)
sc = tinker.ServiceClient()
t0 = time.perf_counter()
tc = sc.create_lora_training_client(base_model=os.environ["BASE_MODEL"], rank=rank).result()
create = time.perf_counter() - t0
data = []
for _ in range(batch):
    ids = rng.integers(10, 2000, seq + 1).tolist()
    data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * seq}))
rows = []
for _ in range(steps):
    t0 = time.perf_counter()
    fb = tc.forward_backward(data, "cross_entropy")
    op = tc.optim_step(types.AdamParams(learning_rate=1e-4))
    submitted = time.perf_counter()
    loss = fb.result().metrics["loss:sum"]
    op.result()
    rows.append({"step": time.perf_counter() - t0, "submit": submitted - t0, "loss": loss})
print("BENCH " + json.dumps({"create": create, "rows": rows}), flush=True)
os._exit(0)
"""


def peft_steps(model_dir: Path, steps: int, batch: int, seq: int, rank: int) -> list[float]:
    """The same SFT step in-process: forward, summed token NLL, backward, AdamW."""
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(10, 2000, (batch, seq + 1)))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules="all-linear"))
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=1e-4,
        betas=(0.9, 0.95),
        eps=1e-12,
        weight_decay=0.0,
    )
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(ids[:, :-1]).logits.float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-logp.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times


def gateway_seconds(base_url: str) -> dict[str, dict[str, float]]:
    """Total seconds and count per route from lorafleet_http_request_seconds."""
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        for part in ("_sum", "_count"):
            prefix = f"lorafleet_http_request_seconds{part}{{"
            if line.startswith(prefix):
                route = line.split('route="', 1)[1].split('"', 1)[0]
                out.setdefault(route, {})[part[1:]] = float(line.rsplit(" ", 1)[1])
    return {r: v for r, v in out.items() if v.get("count")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    if not SDK_PYTHON.exists():
        sys.exit("no tinker 0.38.0 venv: run tests/sdk/setup_venvs.sh")
    from lorafleet_cli.fleet import Fleet, FleetConfig
    from lorafleet_models.tiny import ensure_model

    model_dir = ensure_model("bench", REPO / ".cache" / "models")
    # In-process runs before and after the fleet's run bracket it against load drift.
    before = peft_steps(model_dir, args.steps + 1, args.batch, args.seq, args.rank)[1:]
    with tempfile.TemporaryDirectory() as run_dir:
        config = FleetConfig(
            model_path=model_dir, run_dir=Path(run_dir), trainers=1, rollouts=0, slots=2
        )
        with Fleet(config) as fleet:
            caps = httpx.get(
                f"{fleet.base_url}/api/v1/get_server_capabilities",
                headers={"X-API-Key": fleet.api_key},
                timeout=30,
            ).json()
            base = next(m["model_name"] for m in caps["supported_models"] if m["trainable"])
            env = {
                "TINKER_BASE_URL": fleet.base_url,
                "TINKER_API_KEY": fleet.api_key,
                "BASE_MODEL": base,
                "HF_HUB_OFFLINE": "1",
                "TINKER_TELEMETRY": "0",
            }
            argv = [str(a) for a in (args.steps + 1, args.batch, args.seq, args.rank)]
            proc = subprocess.run(
                [str(SDK_PYTHON), "-c", SDK_SCRIPT, *argv],
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH ")), None)
            if line is None:
                sys.exit(f"SDK run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
            sdk = json.loads(line[len("BENCH ") :])
            gateway = gateway_seconds(fleet.base_url)
    after = peft_steps(model_dir, args.steps + 1, args.batch, args.seq, args.rank)[1:]
    local = before + after
    rows = sdk["rows"][1:]  # the first step of each side warms up
    sdk_step = statistics.median(r["step"] for r in rows)
    local_step = statistics.median(local)
    print(
        json.dumps(
            {
                "model": model_dir.name,
                "steps": args.steps,
                "batch": args.batch,
                "seq": args.seq,
                "rank": args.rank,
                "sdk_step_seconds_median": round(sdk_step, 4),
                "peft_step_seconds_median": round(local_step, 4),
                "peft_median_before_after": [
                    round(statistics.median(before), 4),
                    round(statistics.median(after), 4),
                ],
                "load_average_1m": os.getloadavg()[0],
                "ratio_sdk_over_peft": round(sdk_step / local_step, 3),
                "sdk_submit_seconds_median": round(statistics.median(r["submit"] for r in rows), 4),
                "sdk_create_training_client_seconds": round(sdk["create"], 3),
                "gateway_seconds_by_route": {
                    r: {"total": round(v["sum"], 3), "count": int(v["count"])}
                    for r, v in gateway.items()
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
