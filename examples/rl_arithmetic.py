"""Reinforcement learning with `importance_sampling` on a small arithmetic task.

    eval "$(lorafleet up --detach)"
    python examples/rl_arithmetic.py --iterations 10

Each iteration: publish the current weights to a sampler, sample a group of answers per
problem ("3 + 4 ="), reward 1 for the right number, use group-centred rewards as
advantages, and train on the sampled tokens with the sampler's own logprobs (the
importance-sampling correction keeps the update honest when the policy moved). The mean
reward per iteration is printed; on a real model it rises within a few iterations.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys

import tinker
from common import base_model, done
from tinker import types


def reward(text: str, answer: int) -> float:
    match = re.search(r"-?\d+", text)
    return 1.0 if match and int(match.group()) == answer else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-model", default="")
    ap.add_argument("--iterations", type=int, default=int(os.environ.get("EXAMPLE_ITERS", 10)))
    ap.add_argument("--problems", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)

    sc = tinker.ServiceClient()
    base = base_model(sc, args.base_model)
    tc = done(sc.create_lora_training_client(base_model=base, rank=8))
    tok = tc.get_tokenizer()
    rewards_per_iter = []
    for it in range(args.iterations):
        sampler = done(tc.save_weights_and_get_sampling_client(name=f"rl-{it}"))
        problems = [(rng.randint(0, 9), rng.randint(0, 9)) for _ in range(args.problems)]
        params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=["\n"],
                                      seed=rng.randint(0, 2**31))  # fmt: skip
        futures = []
        for a, b in problems:
            prompt = tok.encode(f"{a} + {b} =", add_special_tokens=False)
            futures.append((prompt, a + b, sampler.sample(
                types.ModelInput.from_ints(prompt), args.group_size, params)))  # fmt: skip
        data, all_rewards = [], []
        for prompt, answer, fut in futures:
            seqs = fut.result().sequences
            rewards = [reward(tok.decode(s.tokens), answer) for s in seqs]
            mean = sum(rewards) / len(rewards)
            all_rewards += rewards
            for s, r in zip(seqs, rewards, strict=True):
                if not s.tokens or r == mean:
                    continue  # zero advantage: nothing to learn from this sample
                n = len(s.tokens)
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(prompt + s.tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": [0] * (len(prompt) - 1) + list(s.tokens),
                        "logprobs": [0.0] * (len(prompt) - 1) + list(s.logprobs),
                        "advantages": [0.0] * (len(prompt) - 1) + [r - mean] * n,
                    },
                ))  # fmt: skip
        mean_reward = sum(all_rewards) / len(all_rewards)
        rewards_per_iter.append(mean_reward)
        if data:
            fb = tc.forward_backward(data, "importance_sampling")
            opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
            loss = fb.result().metrics["loss:sum"]
            opt.result()
        else:
            loss = 0.0
        print(f"iteration {it:>2}: mean reward {mean_reward:.3f}  datums {len(data):>2}  "
              f"loss:sum {loss:+.4f}")  # fmt: skip
    print(f"reward: first {rewards_per_iter[0]:.3f}, last {rewards_per_iter[-1]:.3f}")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
