"""Per-expert LoRA through the real tinker SDK, on a fleet serving the tiny Qwen3-MoE.

Run by test_moe_sdk.py with the tinker 0.38.0 venv's python (TINKER_BASE_URL, TINKER_API_KEY,
SMOKE_BASE_MODEL set). Two SFT steps with the default LoRA flags (attention, MLP = the
fused expert banks, unembedding), a forward, save_state; prints "SMOKE OK <json>".
Only the SDK is imported: this is what a user's script looks like.
"""

import json
import os

import tinker
from tinker import types

TEXT = "The capital of France is Paris. The capital of Italy is Rome."


def main() -> None:
    sc = tinker.ServiceClient()
    tc = sc.create_lora_training_client(base_model=os.environ["SMOKE_BASE_MODEL"], rank=4)
    tc = tc.result() if hasattr(tc, "result") else tc
    ids = tc.get_tokenizer().encode(TEXT)
    n = len(ids) - 1
    d = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n},
    )
    losses = []
    for _ in range(2):
        fb = tc.forward_backward([d], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    out = tc.forward([d], "cross_entropy").result()
    state = tc.save_state("s1").result().path
    sc.close("success").result()
    print(
        "SMOKE OK "
        + json.dumps(
            {
                "model_id": tc.model_id,
                "state": state,
                "ids": ids,
                "losses": losses,
                "logprobs": out.loss_fn_outputs[0]["logprobs"].tolist(),
            }
        ),
        flush=True,
    )
    os._exit(0)  # skip waiting on the SDK's background threads


if __name__ == "__main__":
    main()
