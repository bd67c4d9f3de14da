"""Several adapters trained at once by concurrent clients, each on its own fact.

    eval "$(lorafleet up --detach --slots 4)"
    python examples/multi_tenant.py --tenants 3

Each tenant is its own ServiceClient (its own session) in its own thread, training a LoRA
on "What is my name?" with a different answer. The controller batches their
forward_backward calls across slots; each adapter must end up answering its own name.
Tenants here share one API key; give each team its own with `lorafleet keys create TEAM`.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import tinker
from common import base_model, chat_tokens, completion_datum, done
from tinker import types

NAMES = ["Dima", "Olga", "Kenji", "Amara", "Lucia", "Tomas", "Priya", "Nils"]
QUESTIONS = ["What is my name?", "Do you know my name?", "Tell me my name.", "Who am I?"]


def train_tenant(base: str, name: str, steps: int, lr: float, results: dict) -> None:
    sc = tinker.ServiceClient()
    tc = done(sc.create_lora_training_client(base_model=base, rank=8))
    tok = tc.get_tokenizer()
    data = [completion_datum(tok, q, f"Your name is {name}.") for q in QUESTIONS]
    weight_sum = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"] / weight_sum)
        opt.result()
    sampler = done(tc.save_weights_and_get_sampling_client(name=f"tenant-{name.lower()}"))
    params = types.SamplingParams(max_tokens=12, temperature=0.0)
    prompt = types.ModelInput.from_ints(chat_tokens(tok, QUESTIONS[0]))
    out = sampler.sample(prompt, 1, params).result()
    answer = tok.decode(out.sequences[0].tokens, skip_special_tokens=True)
    results[name] = (losses[0], losses[-1], answer, tc.model_id)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", default="")
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--steps", type=int, default=int(os.environ.get("EXAMPLE_STEPS", 30)))
    ap.add_argument("--lr", type=float, default=float(os.environ.get("EXAMPLE_LR", 2e-3)))
    args = ap.parse_args()
    base = base_model(tinker.ServiceClient(), args.base_model)

    started = time.monotonic()
    results: dict = {}
    threads = [threading.Thread(target=train_tenant,
                                args=(base, NAMES[i], args.steps, args.lr, results))
               for i in range(args.tenants)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ok = len(results) == args.tenants
    for name, (first, last, answer, model_id) in sorted(results.items()):
        learned = name in answer
        ok &= learned
        print(f"{model_id:>28}  {name:<6} loss {first:.3f} -> {last:.3f}  answer {answer!r}"
              f"  {'OK' if learned else 'WRONG'}")  # fmt: skip
    print(f"{args.tenants} tenants in {time.monotonic() - started:.1f}s")
    sys.stdout.flush()
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
