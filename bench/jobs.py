"""A managed Q&A job through the fleet vs the same loop in-process with PEFT.

    .venv/bin/python bench/jobs.py [--model tiny|bench] [--passes 4] [--rank 8]

A 12-unit job (3 pairs x 4 phrasings) with a fixed number of passes (no early stop):
`POST /v1/lora/train-file-qa` on a fleet (Redis, controller, one trainer, gateway) on
loopback, timed from the request to the synchronous answer. The in-process side builds the
same units with the controller's own job code (`lorafleet_controller.jobs.units`), then
runs the same work with transformers + PEFT: the initial loss over every unit, one
forward/backward per update with token-mean weights, global-norm clipping at 1.0, AdamW
(0.9, 0.95, 1e-12) in the same seeded order, and a final adapter save. The in-process run
happens before and after the fleet's, bracketing it against load drift. Prints one JSON
object; `ratio_peft_over_fleet` >= 0.9 is the target (the fleet within ~10% of a bare loop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
PAIRS = [
    {"Q": "What is my name?", "A": "Dima"},
    {"Q": "Where do I live?", "A": "Lisbon"},
    {"Q": "What is my cat called?", "A": "Tom"},
]
LR = 0.005


def peft_job(model_dir: Path, passes: int, rank: int, out: Path) -> float:
    """The job's loop in-process; its wall seconds."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lorafleet_controller.jobs.data import Pair
    from lorafleet_controller.jobs.tokenizer import HfCodec
    from lorafleet_controller.jobs.units import qa_plan

    codec = HfCodec(AutoTokenizer.from_pretrained(model_dir))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # Timed from here: the fleet has its model loaded too, and makes the adapter per job.
    start = time.perf_counter()
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules="all-linear"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    positions = model.config.max_position_embeddings
    plan = qa_plan(codec, [Pair(p["Q"], p["A"]) for p in PAIRS], 0.0, 0, 0, positions)

    def loss_of(chunk, weight: float) -> torch.Tensor:
        logits = model(torch.tensor([chunk.tokens])).logits[0].float()
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(chunk.targets)[:, None])
        return -(logp[:, 0] * torch.tensor(chunk.mask, dtype=torch.float32)).sum() * weight

    chunks = [c for u in plan.train for c in u.chunks]
    with torch.no_grad():
        total = sum(c.prediction_tokens for c in chunks)
        sum(float(loss_of(c, 1.0 / total)) for c in chunks)  # the initial-loss check
    for number in range(1, passes + 1):
        for group in plan.pass_groups(number, 0, 1):
            n = sum(c.prediction_tokens for c in group)
            loss = sum(loss_of(c, 1.0 / n) for c in group)
            loss.backward()  # type: ignore[union-attr]
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    model.save_pretrained(out)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=("tiny", "bench"))
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    from lorafleet_cli.fleet import Fleet, FleetConfig
    from lorafleet_models.tiny import ensure_model

    model_dir = ensure_model(args.model, REPO / ".cache" / "models")
    with tempfile.TemporaryDirectory() as tmp:
        peft_job(model_dir, 1, args.rank, Path(tmp) / "warm")  # imports and caches
        before = peft_job(model_dir, args.passes, args.rank, Path(tmp) / "before")
        config = FleetConfig(
            model_path=model_dir, run_dir=Path(tmp) / "fleet", trainers=1, rollouts=0, slots=2
        )
        with Fleet(config) as fleet:
            c = httpx.Client(
                base_url=fleet.base_url, headers={"X-API-Key": fleet.api_key}, timeout=1800
            )
            params = {
                "max_iters": str(args.passes),
                "rank": str(args.rank),
                "seed": "0",
                "learning_rate": str(LR),
                "loss_target": "0",
                "early_stop": "0",
            }
            c.post("/v1/lora/train-qa", params={**params, "max_iters": "1"}, json=PAIRS[0])
            c.post("/v1/lora/reset")  # the warm-up made the default run; start afresh
            t0 = time.perf_counter()
            job = c.post("/v1/lora/train-file-qa", params=params, json=PAIRS).json()
            fleet_seconds = time.perf_counter() - t0
        after = peft_job(model_dir, args.passes, args.rank, Path(tmp) / "after")
    peft_seconds = statistics.mean([before, after])
    print(
        json.dumps(
            {
                "model": model_dir.name,
                "units": job["unitCount"],
                "passes": job["passCount"],
                "optimizer_updates": job["optimizerUpdateCount"],
                "fleet_job_seconds": round(fleet_seconds, 3),
                "fleet_job_server_seconds": round(job["finishedAt"] - job["startedAt"], 3),
                "peft_seconds_before_after": [round(before, 3), round(after, 3)],
                "ratio_peft_over_fleet": round(peft_seconds / fleet_seconds, 3),
                "final_train_loss": job["finalTrainLoss"],
                "load_average_1m": os.getloadavg()[0],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
