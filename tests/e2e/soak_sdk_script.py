"""Tenants cycling through everything a team does, through the real SDK, for a while.

Run by tests/e2e/test_soak.py with a tinker 0.38 venv's python (TINKER_BASE_URL,
SMOKE_BASE_MODEL, SOAK_KEYS: a JSON list of API keys, one tenant each; SOAK_SECONDS: how long
to start new cycles). Each tenant, in its own thread, runs cycles back to back until the time
is up; a cycle is a team's whole life on the fleet: a session, a run (rank 4, seed 0), two
steps, a saved state, a named sampler export, an unnamed sampler (what RL loops make every
step), a sample on each, a sampler made from the saved state, the checkpoints deleted, the
session closed (its run retired with it). Prints "RESULT <json>": per tenant the outcome of
every cycle (losses, tokens, logprobs) and the errors the SDK raised.
"""

import faulthandler
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import tinker
from tinker import types

PROMPT = [5, 17, 33, 90, 12, 7, 41]
GREEDY = types.SamplingParams(max_tokens=6, temperature=0.0, seed=1)


def datum(k: int) -> types.Datum:
    t = [(11 * k + 5 * j) % 250 + 1 for j in range(16)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(t[:-1]),
        loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * (len(t) - 1)},
    )


def sample(sampler: "tinker.SamplingClient") -> dict[str, list[float]]:
    seq = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0]
    return {"tokens": list(seq.tokens), "logprobs": list(seq.logprobs or [])}


def cycle(key: str, n: int) -> dict[str, object]:
    sc = tinker.ServiceClient(api_key=key)
    try:
        tc = sc.create_lora_training_client(
            base_model=os.environ["SMOKE_BASE_MODEL"], rank=4, seed=0
        )
        losses = []
        for step in range(2):
            out = tc.forward_backward([datum(step), datum(step + 7)], "cross_entropy").result()
            losses.append(out.metrics["loss:sum"])
            tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        state = tc.save_state(f"state-{n}").result().path
        named = tc.save_weights_for_sampler(f"export-{n}").result().path
        unnamed = tc.save_weights_and_get_sampling_client()
        from_path = sc.create_sampling_client(model_path=named)
        from_state = sc.create_sampling_client(model_path=state)
        samples = [sample(unnamed), sample(from_path), sample(from_state)]
        rest = tinker.RestClient(api_key=key)
        for path in (state, named):
            rest.delete_checkpoint_from_tinker_path(path).result()
        return {"losses": losses, "samples": samples}
    finally:
        sc.close("success").result()


def tenant(key: str, deadline: float) -> dict[str, object]:
    cycles: list[dict[str, object]] = []
    errors: list[str] = []
    n = 0
    while not cycles or time.monotonic() < deadline:
        try:
            cycles.append(cycle(key, n))
        except Exception as exc:  # what the SDK raised is what a user sees
            errors.append(f"cycle {n}: {type(exc).__name__}: {exc}")
            if len(errors) > 3:
                break
        n += 1
    return {"cycles": cycles, "errors": errors}


def main() -> None:
    keys = json.loads(os.environ["SOAK_KEYS"])
    seconds = float(os.environ["SOAK_SECONDS"])
    deadline = time.monotonic() + seconds
    # A cycle stuck past any reasonable time prints every thread's stack and exits, so the
    # test reports where instead of timing out blind.
    stuck = seconds + float(os.environ.get("SOAK_STUCK", "600"))
    faulthandler.dump_traceback_later(stuck, exit=True)
    with ThreadPoolExecutor(len(keys)) as pool:
        results = list(pool.map(lambda k: tenant(k, deadline), keys))
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
