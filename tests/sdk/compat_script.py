"""The reference flow of tinker-api.md §12, run with a real tinker SDK against a gateway.

Run by tests/sdk/test_sdk_compat.py with each SDK venv's python:
    TINKER_BASE_URL=http://127.0.0.1:PORT TINKER_API_KEY=tml-... SMOKE_BASE_MODEL=<model dir> \
        .venvs/tinker-0.38.0/bin/python -W error::FutureWarning tests/sdk/compat_script.py
It prints one JSON line starting with "SMOKE OK" carrying what the caller checks further.
Only the SDK is imported (no lorafleet code): this is what a user's script looks like.
"""

import json
import math
import os

import tinker
from tinker import types

NEW = not tinker.__version__.startswith("0.24")
BASE = os.environ["SMOKE_BASE_MODEL"]


def done(x):
    """0.38's create_* calls return futures; 0.24.1's return the object."""
    return x.result() if NEW else x


def main() -> None:
    sc = tinker.ServiceClient()
    rest = tinker.RestClient() if NEW else sc.create_rest_client()
    caps = rest.get_server_capabilities().result() if NEW else sc.get_server_capabilities()
    assert BASE in [m.model_name for m in caps.supported_models], caps
    tc = done(sc.create_lora_training_client(base_model=BASE, rank=8))
    tok = tc.get_tokenizer()
    ids = tok.encode("The capital of France is Paris.")
    n = len(ids) - 1
    d = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * n},
    )
    fb, op = (
        tc.forward_backward([d], "cross_entropy"),
        tc.optim_step(types.AdamParams(learning_rate=1e-4)),
    )
    r = fb.result()
    op.result()
    lps = r.loss_fn_outputs[0]["logprobs"].tolist()
    assert "loss:sum" in r.metrics and len(lps) == n, (r.metrics, len(lps))
    assert math.isclose(r.metrics["loss:sum"], -sum(lps), rel_tol=1e-4), (r.metrics, sum(lps))

    fwd = tc.forward([d], "cross_entropy").result()
    fwd_lps = fwd.loss_fn_outputs[0]["logprobs"].tolist()
    assert len(fwd_lps) == n

    ppo = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "logprobs": fwd_lps, "advantages": [1.0] * n},
    )
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    ppo_out = tc.forward_backward([ppo], "ppo", cfg).result()
    assert "loss:sum" in ppo_out.metrics
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    at_save = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()

    state = tc.save_state("s1").result().path
    spath = tc.save_weights_for_sampler("s1").result().path
    assert state == f"tinker://{tc.model_id}/weights/s1", state
    assert spath == f"tinker://{tc.model_id}/sampler_weights/s1", spath
    eph = done(tc.save_weights_and_get_sampling_client())
    eph_out = eph.sample(
        types.ModelInput.from_ints(ids[:4]), 1, types.SamplingParams(max_tokens=3)
    ).result()
    assert len(eph_out.sequences) == 1

    smp = done(sc.create_sampling_client(model_path=spath))
    params = types.SamplingParams(max_tokens=4, seed=7)
    out = smp.sample(types.ModelInput.from_ints(ids[:4]), 2, params).result()
    assert len(out.sequences) == 2 and out.sequences[0].logprobs is not None
    for seq in out.sequences:
        assert len(seq.logprobs) == len(seq.tokens) and seq.stop_reason in ("stop", "length")
    prompt_lps = smp.compute_logprobs(types.ModelInput.from_ints(ids[:4])).result()
    assert len(prompt_lps) == 4 and prompt_lps[0] is None, prompt_lps

    listed = rest.list_checkpoints(tc.model_id).result()
    kinds = sorted(c.checkpoint_id for c in listed.checkpoints)
    assert "weights/s1" in kinds and "sampler_weights/s1" in kinds, kinds
    rest.delete_checkpoint(tc.model_id, "sampler_weights/s1").result()
    after = sorted(c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints)
    assert "sampler_weights/s1" not in after, after
    run = rest.get_training_run(tc.model_id).result()
    assert run.training_run_id == tc.model_id

    tc2 = done(sc.create_training_client_from_state_with_optimizer(state))
    assert (
        tc2.model_id != tc.model_id
        and tc2.model_id.rsplit(":train:", 1)[0] == tc.model_id.rsplit(":train:", 1)[0]
    )
    resumed = tc2.forward([d], "cross_entropy").result()
    resumed_lps = resumed.loss_fn_outputs[0]["logprobs"].tolist()
    if NEW:
        sc.close("success").result()
    print(
        "SMOKE OK "
        + json.dumps(
            {
                "version": tinker.__version__,
                "model_id": tc.model_id,
                "model_id2": tc2.model_id,
                "fwd_logprobs": fwd_lps,
                "at_save_logprobs": at_save,
                "resumed_logprobs": resumed_lps,
                "sample": [s.tokens for s in out.sequences],
            }
        ),
        flush=True,
    )
    os._exit(0)  # skip waiting on the SDK's background threads


if __name__ == "__main__":
    main()
