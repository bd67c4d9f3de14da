"""Truncated-BPTT windows: carried keys/values vs the context computed again per window.

    .venv/bin/python bench/bptt.py [--model tiny|bench] [--tokens 5000] [--chunk-tokens 32]

One document of `--tokens` tokens, cut by the jobs' own code (`jobs.units.windows`, context
shifted past the model's positions), trained one window per `forward_backward` call the way
a document job sends them, with an optimizer step after each (accumulation 1), on one
`TrainerEngine` slot in-process. Twice: as the trainer runs (each window reads the keys and
values the previous one left) and with the carried cache dropped before every call (the
context computed again each time, what the trainer did before issue 23). Prints one JSON
object: wall seconds and the trainer's own forward token counts of each, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def run(model_dir: Path, windows: list, carry: bool) -> dict[str, float]:
    from lorafleet_trainer.domain import (
        AdamParams,
        Datum,
        ForwardBackwardInput,
        ForwardBackwardItem,
        LoraSpec,
    )
    from lorafleet_trainer.engine import TrainerEngine

    with tempfile.TemporaryDirectory() as tmp:
        engine = TrainerEngine.from_pretrained(
            model_dir, device="cpu", num_slots=1, max_rank=8, storage_root=Path(tmp)
        )
        engine.bind(0, "r", LoraSpec(rank=8, seed=0, train_attn=True, train_mlp=True))
        computed = 0.0
        start = time.perf_counter()
        for i, w in enumerate(windows):
            if not carry:
                engine.slots.bindings[0].carried = None
            datum = Datum(
                list(w.tokens),
                {"target_tokens": torch.tensor(w.targets), "weights": torch.ones(len(w.tokens))},
                context=list(w.context),
                window=True,
            )
            inp = ForwardBackwardInput([datum], "cross_entropy", group_tokens=len(w.tokens))
            (out,) = engine.forward_backward([ForwardBackwardItem(f"fb{i}", 0, "r", inp)])
            computed += out.metrics["forward_tokens:sum"]
            engine.optim_step(f"step{i}", 0, "r", AdamParams(learning_rate=1e-3))
        return {"seconds": time.perf_counter() - start, "forward_tokens": computed}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=5000)
    ap.add_argument("--chunk-tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    from lorafleet_controller.jobs.units import windows
    from lorafleet_models.tiny import ensure_model

    model_dir = ensure_model(args.model, REPO / ".cache" / "models")
    config = AutoConfig.from_pretrained(model_dir)
    positions = config.max_position_embeddings
    gen = torch.Generator().manual_seed(0)
    doc = torch.randint(0, config.vocab_size, (args.tokens + 1,), generator=gen).tolist()
    cut = list(windows(doc, args.chunk_tokens, positions))
    torch.set_num_threads(1)
    carried = run(model_dir, cut, carry=True)
    again = run(model_dir, cut, carry=False)
    print(
        json.dumps(
            {
                "model": model_dir.name,
                "positions": positions,
                "document_tokens": args.tokens,
                "chunk_tokens": args.chunk_tokens,
                "windows": len(cut),
                "carried_seconds": round(carried["seconds"], 3),
                "recomputed_seconds": round(again["seconds"], 3),
                "carried_forward_tokens_per_token": round(
                    carried["forward_tokens"] / args.tokens, 4
                ),
                "recomputed_forward_tokens_per_token": round(
                    again["forward_tokens"] / args.tokens, 4
                ),
                "speedup": round(again["seconds"] / carried["seconds"], 3),
                "load_average_1m": os.getloadavg()[0],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
