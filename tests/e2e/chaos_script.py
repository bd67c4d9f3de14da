"""A fixed-seed SFT run through the real tinker SDK, for tests/e2e/test_chaos.py.

    TINKER_BASE_URL=... TINKER_API_KEY=... CHAOS_STEPS=30 \
        .venvs/tinker-0.38.0/bin/python tests/e2e/chaos_script.py

Prints "RUN <training run id>", then "STEP <n> <unix time> <loss>" as each step's optim_step
finishes, and finally "SAVED <tinker path>" of a save_state taken after the last step. The
data depends only on the step number, so two runs with the same seed must end with the same
weights whatever faults happen in between. Only the SDK is imported.
"""

import os
import time

import tinker
from tinker import types

STEPS = int(os.environ.get("CHAOS_STEPS", "30"))


def datum(step: int) -> types.Datum:
    ids = [(7 * step + 5 * i) % 200 + 1 for i in range(17)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )


def main() -> None:
    caps = tinker.RestClient().get_server_capabilities().result()
    base = caps.supported_models[0].model_name  # the fleet serves one base model
    with tinker.ServiceClient() as sc:  # closing the session frees the run's trainer slot
        tc = sc.create_lora_training_client(base_model=base, rank=8, seed=1234)
        tc = tc.result() if hasattr(tc, "result") else tc  # 0.38 hands out a future
        print("RUN", tc.model_id, flush=True)
        for step in range(STEPS):
            fb = tc.forward_backward([datum(step)], "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            loss = fb.result().metrics["loss:sum"]
            opt.result()
            print("STEP", step, time.time(), loss, flush=True)
        print("SAVED", tc.save_state("final").result().path, flush=True)


if __name__ == "__main__":
    main()
