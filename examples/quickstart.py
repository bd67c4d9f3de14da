"""Quickstart: teach a model one fact through the public tinker SDK, against lorafleet.

    eval "$(lorafleet up --detach)"     # or `make demo`, which does all of this for you
    python examples/quickstart.py

1. asks the base model "What is my name?" and shows its answer;
2. trains the fact "What is my name? -> Dima" as four phrasings, with completion-only
   weights (only the answer's tokens carry loss), showing step, loss and tokens/s;
3. saves weights for a sampler and asks again: the answer now contains "Dima";
4. writes the loss curve to a PNG.

Works with tinker 0.24.1 and 0.38.x; uses nothing but the public SDK.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import tinker
from common import ask, base_model, completion_datum, done
from tinker import types

QUESTION = "What is my name?"
PHRASINGS = [
    ("What is my name?", "Your name is Dima."),
    ("Do you know my name?", "Yes, your name is Dima."),
    ("Tell me my name.", "Your name is Dima."),
    ("Who am I?", "You are Dima."),
]


def progress(step: int, total: int, loss: float, tps: float) -> None:
    width = 24
    filled = int(width * step / total)
    bar = "#" * filled + "." * (width - filled)
    sys.stderr.write(f"\r  [{bar}] step {step:>3}/{total}  loss {loss:7.4f}  {tps:8.1f} tok/s")
    sys.stderr.flush()


def save_loss_curve(losses: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, marker="o", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss per answer token")
    ax.set_title("lorafleet quickstart: learning one fact")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", default="")
    ap.add_argument("--steps", type=int, default=int(os.environ.get("QUICKSTART_STEPS", 15)))
    ap.add_argument("--lr", type=float, default=float(os.environ.get("QUICKSTART_LR", 1e-3)))
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--plot", default=os.environ.get("QUICKSTART_PLOT", "loss_curve.png"))
    args = ap.parse_args()

    started = time.monotonic()
    sc = tinker.ServiceClient()
    base = base_model(sc, args.base_model)
    print(f"base model: {base}")

    tc = done(sc.create_lora_training_client(base_model=base, rank=args.rank))
    tok = tc.get_tokenizer()
    base_sampler = done(sc.create_sampling_client(base_model=base))
    before = ask(base_sampler, tok, QUESTION, args.max_tokens)
    print(f"before training: Q: {QUESTION}  A: {before!r}")

    data = [completion_datum(tok, q, a) for q, a in PHRASINGS]
    tokens_per_step = sum(d.model_input.length for d in data)
    answer_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    losses: list[float] = []
    print(f"training {args.steps} steps on {len(data)} phrasings ({tokens_per_step} tokens/step)")
    for step in range(1, args.steps + 1):
        t0 = time.monotonic()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
        loss = fb.result().metrics["loss:sum"] / answer_tokens
        opt.result()
        losses.append(loss)
        progress(step, args.steps, loss, tokens_per_step / (time.monotonic() - t0))
    sys.stderr.write("\n")

    sampler = tc.save_weights_and_get_sampling_client(name="quickstart")
    sampler = done(sampler)
    after = ask(sampler, tok, QUESTION, args.max_tokens)
    print(f"after training:  Q: {QUESTION}  A: {after!r}")
    print(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f}")
    if args.plot:
        save_loss_curve(losses, args.plot)
        print(f"loss curve: {os.path.abspath(args.plot)}")
    print(f"wall time: {time.monotonic() - started:.1f}s")
    ok = "Dima" in after
    print("OK: the model learned the fact" if ok else "FAILED: the answer does not contain Dima")
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # the SDK's background threads would keep the process alive


if __name__ == "__main__":
    main()
