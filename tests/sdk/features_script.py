"""What users' scripts expect beyond the reference flow, run with a real tinker SDK.

Per-token `elementwise_loss` for every built-in loss, omitted cross_entropy weights, gspo,
top-k prompt logprobs, forward_backward_custom, inflight samplers (0.38), LoRA options in
user_metadata, and the errors users see for a bad option or an unknown checkpoint. Each
feature is tried on its own and reported (value or error text) in one "SMOKE OK" JSON line;
tests/sdk/test_sdk_features.py checks them. Env as compat_script.py. Only the SDK is imported.
"""

import json
import os
import traceback

import tinker
from tinker import types

NEW = not tinker.__version__.startswith("0.24")
BASE = os.environ["SMOKE_BASE_MODEL"]
TEXT = "The capital of France is Paris."
RL_LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")


def done(x):
    """0.38's create_* calls return futures; 0.24.1's return the object."""
    return x.result() if hasattr(x, "result") else x


def attempt(out, name, fn):
    try:
        out[name] = fn()
    except Exception as exc:  # reported, and checked by the test
        out[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}


def main() -> None:
    sc = tinker.ServiceClient()
    rest = tinker.RestClient() if NEW else sc.create_rest_client()
    options = {
        "lorafleet.alpha": "16",
        "lorafleet.target_modules": "q_proj,v_proj",
        "lorafleet.dropout": "0.0",
        "team": "a",
    }
    # No LoRA on lm_head: the CPU rollout engine serves attention and MLP adapters only.
    tc = done(
        sc.create_lora_training_client(
            base_model=BASE, rank=4, train_unembed=False, user_metadata=options
        )
    )
    tok = tc.get_tokenizer()
    ids = tok.encode(TEXT)
    n = len(ids) - 1
    prompt = types.ModelInput.from_ints(ids[:-1])
    out = {"version": tinker.__version__, "n": n}

    def datum(**inputs):
        return types.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": ids[1:], **inputs})

    def outputs(result):
        return {
            "metrics": dict(result.metrics),
            "fields": {k: v.tolist() for k, v in result.loss_fn_outputs[0].items()},
        }

    lps = tc.forward([datum(weights=[1.0] * n)], "cross_entropy").result()
    lps = lps.loss_fn_outputs[0]["logprobs"].tolist()
    half = [1.0 if i % 2 else 0.0 for i in range(n)]
    attempt(
        out,
        "cross_entropy",
        lambda: outputs(tc.forward([datum(weights=half)], "cross_entropy").result()),
    )
    attempt(
        out,
        "zero_weights",
        lambda: outputs(tc.forward([datum(weights=[0.0] * n)], "cross_entropy").result()),
    )
    attempt(
        out, "omitted_weights", lambda: outputs(tc.forward([datum()], "cross_entropy").result())
    )
    attempt(
        out,
        "explicit_ones",
        lambda: outputs(tc.forward([datum(weights=[1.0] * n)], "cross_entropy").result()),
    )
    # RL losses against slightly different sampling logprobs, so ratios are not all 1.
    old = [lp - 0.05 * (i % 3) for i, lp in enumerate(lps)]
    adv = [1.0 if i % 2 else -0.5 for i in range(n)]
    for loss in RL_LOSSES:
        attempt(
            out,
            loss,
            lambda loss=loss: outputs(
                tc.forward([datum(logprobs=old, advantages=adv)], loss).result()
            ),
        )

    def gspo_step():
        result = tc.forward_backward([datum(logprobs=old, advantages=adv)], "gspo").result()
        step = tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        after = tc.forward([datum(weights=[1.0] * n)], "cross_entropy").result()
        moved = after.loss_fn_outputs[0]["logprobs"].tolist() != lps
        return {"loss": result.metrics["loss:sum"], "step": dict(step.metrics), "moved": moved}

    attempt(out, "gspo_step", gspo_step)

    def custom():
        def loss_fn(data, logprobs):
            loss = sum(-lp.sum() for lp in logprobs)
            return loss, {"custom:sum": float(loss)}

        before = tc.forward([datum(weights=[1.0] * n)], "cross_entropy").result()
        result = done(tc.forward_backward_custom([datum(weights=[1.0] * n)], loss_fn))
        expected = -sum(before.loss_fn_outputs[0]["logprobs"].tolist())
        return {"metrics": dict(result.metrics), "expected": expected}

    attempt(out, "custom", custom)

    def topk():
        sampler = done(tc.save_weights_and_get_sampling_client())
        got = {}
        for num in (1, 3):
            params = types.SamplingParams(max_tokens=2, seed=3)
            result = sampler.sample(
                types.ModelInput.from_ints(ids[:5]), num, params, topk_prompt_logprobs=4
            ).result()
            topk_rows = result.topk_prompt_logprobs
            got[str(num)] = {
                "sequences": len(result.sequences),
                "prompt_logprobs": result.prompt_logprobs,
                "topk": None
                if topk_rows is None
                else [None if row is None else [list(pair) for pair in row] for row in topk_rows],
            }
        return got

    attempt(out, "topk", topk)
    if NEW:

        def inflight():
            sampler = tc.save_weights_and_get_sampling_client(kind="inflight").result()
            params = types.SamplingParams(max_tokens=3, seed=5)

            def draw(client):
                got = client.sample(types.ModelInput.from_ints(ids[:4]), 1, params).result()
                return list(got.sequences[0].tokens), list(got.sequences[0].logprobs)

            first = draw(sampler)
            # A step, then a new version: the inflight sampler follows it (a pinned one would not).
            tc.forward_backward([datum(weights=[1.0] * n)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
            newest = draw(tc.save_weights_and_get_sampling_client().result())
            after = draw(sampler)
            return {"tokens": first[0], "follows": after == newest, "moved": after != first}

        attempt(out, "inflight", inflight)
    attempt(
        out,
        "run",
        lambda: {"user_metadata": rest.get_training_run(tc.model_id).result().user_metadata},
    )
    attempt(
        out,
        "bad_option",
        lambda: (
            done(
                sc.create_lora_training_client(
                    base_model=BASE, rank=4, user_metadata={"lorafleet.alpha": "sixteen"}
                )
            ).model_id
        ),
    )
    if NEW:  # 0.38 downloads external weights by tinker path
        missing = f"tinker://{tc.model_id}/external_weights/never-saved"
        attempt(
            out, "unknown_checkpoint", lambda: rest.get_external_weights_urls(missing).result().urls
        )
    else:
        attempt(
            out,
            "unknown_checkpoint",
            lambda: rest.get_checkpoint_archive_url(tc.model_id, "checkpoint-123").result().url,
        )

    def saved():
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()  # custom's gradient
        fwd = tc.forward([datum(weights=[1.0] * n)], "cross_entropy").result()
        path = tc.save_state("options").result().path
        return {
            "model_id": tc.model_id,
            "path": path,
            "ids": ids,
            "logprobs": fwd.loss_fn_outputs[0]["logprobs"].tolist(),
        }

    attempt(out, "saved", saved)
    print("SMOKE OK " + json.dumps(out), flush=True)
    os._exit(0)  # skip waiting on the SDK's background threads


if __name__ == "__main__":
    main()
