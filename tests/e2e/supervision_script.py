"""A fixed-seed training run through the tinker SDK, for the supervision fault tests.

Run with an SDK venv's python; TINKER_BASE_URL / TINKER_API_KEY name the fleet, STEPS the
number of forward_backward + optim_step pairs, BASE_MODEL the model. Prints "step N" after
each optim_step (the test injects its fault on that signal) and finally "RUN <model_id>"
once the state is saved as weights/final.
"""

import os

import tinker
from tinker import types


def main() -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(
        base_model=os.environ["BASE_MODEL"], rank=4, seed=1234
    ).result()
    ids = tc.get_tokenizer().encode("The fleet restarts what crashes, and forgets nothing.")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    for step in range(int(os.environ["STEPS"])):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        fb.result()
        print(f"step {step + 1}", flush=True)
    tc.save_state("final").result()
    print(f"RUN {tc.model_id}", flush=True)
    os._exit(0)  # skip waiting on the SDK's background threads


if __name__ == "__main__":
    main()
