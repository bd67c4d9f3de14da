"""Many tenants' adapters through the real SDK, more than a rollout keeps loaded.

Run by tests/e2e/test_many_adapters_sdk.py with a tinker venv's python (TINKER_BASE_URL,
SMOKE_BASE_MODEL, MANY_KEYS: a JSON list of API keys, one tenant each; MANY_PHASE).

`publish`: every tenant trains one step of its own run (ranks 4, 8, 16 in turn), saves its
weights for the sampler and samples greedily; eight tenants at a time, as many teams would.
Then every adapter is sampled again in shuffled order. Prints "RESULT <json>": per tenant its
sampler path, first and second tokens, and the errors the SDK raised.

`reopen`: a new client per tenant (the publishing process and its sessions are gone) opens
each sampler path (MANY_PATHS) and samples the same prompt, eight at a time; prints "SAMPLED
<tenant>" as each returns, then the RESULT with each tenant's tokens.
"""

import json
import os
import random
from concurrent.futures import ThreadPoolExecutor

import tinker
from tinker import types

PROMPT = [5, 17, 33, 90, 12, 7, 41]
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0, seed=1)
RANKS = (4, 8, 16)


def datum(i: int) -> types.Datum:
    t = [(13 * i + 7 * k) % 250 + 1 for k in range(12)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(t[:-1]),
        loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
    )


def sample(sampler: "tinker.SamplingClient") -> list[int]:
    result = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result()
    return list(result.sequences[0].tokens)


def publish(i: int, key: str) -> dict[str, object]:
    sc = tinker.ServiceClient(api_key=key)
    tc = sc.create_lora_training_client(
        base_model=os.environ["SMOKE_BASE_MODEL"], rank=RANKS[i % len(RANKS)], seed=i
    )
    # A large step, so each tenant's adapter samples differently from the base and the others.
    tc.forward_backward([datum(i)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.2)).result()
    path = tc.save_weights_for_sampler(f"t{i}").result().path
    sampler = sc.create_sampling_client(model_path=path)
    return {"path": path, "first": sample(sampler), "sampler": sampler}


def main() -> None:
    keys = json.loads(os.environ["MANY_KEYS"])
    errors: list[str] = []
    out: dict[int, dict[str, object]] = {}

    def guarded(fn, i, *args):  # what the SDK raised is what a user sees
        try:
            return fn(i, *args)
        except Exception as exc:
            errors.append(f"{i}: {type(exc).__name__}: {exc}")
            return None

    if os.environ["MANY_PHASE"] == "publish":
        with ThreadPoolExecutor(8) as pool:
            done = list(pool.map(lambda ik: guarded(publish, *ik), enumerate(keys)))
        out = {i: r for i, r in enumerate(done) if r is not None}
        order = list(out)
        random.Random(2026).shuffle(order)
        for i in order:
            again = guarded(lambda _i: sample(out[_i]["sampler"]), i)
            out[i]["again"] = again
        result = {
            str(i): {"path": r["path"], "first": r["first"], "again": r["again"]}
            for i, r in out.items()
        }
    else:
        paths = json.loads(os.environ["MANY_PATHS"])

        def reopen(i: int, key: str) -> list[int]:
            sampler = tinker.ServiceClient(api_key=key).create_sampling_client(
                model_path=paths[str(i)]
            )
            tokens = sample(sampler)
            print(f"SAMPLED {i}", flush=True)  # the test restarts the rollout after the first
            return tokens

        with ThreadPoolExecutor(8) as pool:
            tokens = list(pool.map(lambda ik: guarded(reopen, *ik), enumerate(keys)))
        result = {str(i): t for i, t in enumerate(tokens)}
    print("RESULT " + json.dumps({"errors": errors, "tenants": result}), flush=True)


if __name__ == "__main__":
    main()
