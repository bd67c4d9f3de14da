"""The tenants of the fault campaign (tests/e2e/test_campaign.py), through the real tinker SDK
and the gateway's REST, in one process (a thread per tenant, each its own API key and
session):

    CAMPAIGN_SPEC='{"base_url": ..., "tenants": [...]}' CAMPAIGN_OUT=result.json \
        .venvs/tinker-0.38.0/bin/python tests/e2e/campaign_script.py

A tenant is a fixed-seed loop of forward_backward + optim_step with its own loss and rank
("train"), the same plus a save_weights_for_sampler and a seeded sample per step
("sampler"), or one managed job ("job", /v1/lora/train-file-qa). Its data depends only on its seed
and the step number, so a run with faults must end exactly where a run without them does.

A tenant trains `steps` steps when the spec gives them (the reference run); otherwise it
trains until the file `stop_file` exists and at least `min_steps` are done (the run under
faults, which the injector ends), and the result records how many it did. Prints "READY"
once every run exists and the job is submitted (the injector starts then), "RUN <tenant>
<run id>" for each training run (the runs paging faults page out), and
"OP <tenant> <n> <unix time>" as each operation completes (recovery times are read from
these). The result file holds every operation's result and each run's final save_state.
Only the SDK (and httpx, which it depends on) is imported.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from typing import Any

import httpx
import tinker
from tinker import types

SPEC: dict[str, Any] = json.loads(os.environ["CAMPAIGN_SPEC"])
OUT = os.environ["CAMPAIGN_OUT"]
LR = 1e-3
_print_lock = threading.Lock()


def say(*words: object) -> None:
    with _print_lock:
        print(*words, flush=True)


def done(x: Any) -> Any:
    """0.38 hands out futures where 0.24 returned values."""
    return x.result() if hasattr(x, "result") else x


def datum(seed: int, step: int, i: int, loss: str) -> types.Datum:
    n = 10 + (seed + step + i) % 7
    ids = [(31 * seed + 7 * step + 5 * j + 3 * i) % 200 + 1 for j in range(n + 1)]
    inputs: dict[str, Any] = {"target_tokens": ids[1:]}
    if loss == "cross_entropy":
        inputs["weights"] = [1.0] * n
    else:  # the RL losses: a fixed sampler logprob and advantage per position
        inputs["logprobs"] = [-1.0 - 0.05 * ((j + step) % 7) for j in range(n)]
        inputs["advantages"] = [0.5 * ((j + i + step) % 3 - 1) for j in range(n)]
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


def fb_result(out: Any) -> dict[str, Any]:
    return {
        "metrics": dict(out.metrics),
        "outputs": [{k: v.tolist() for k, v in o.items()} for o in out.loss_fn_outputs],
    }


class Tenant:
    def __init__(self, spec: dict[str, Any], ready: threading.Barrier) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.ready = ready
        self.result: dict[str, Any] = {"ops": []}

    def more(self, step: int) -> bool:
        if "steps" in SPEC:
            return step < SPEC["steps"][self.name]
        return step < SPEC["min_steps"] or not os.path.exists(SPEC["stop_file"])

    def op(self, result: Any) -> None:
        self.result["ops"].append(result)
        say("OP", self.name, len(self.result["ops"]), time.time())

    def run(self) -> None:
        try:
            if self.spec["kind"] == "job":
                self.job()
            else:
                self.train()
        except threading.BrokenBarrierError:  # another tenant failed before READY
            self.result["error"] = "aborted"
        except BaseException:
            self.result["error"] = traceback.format_exc()
            self.ready.abort()
            raise

    def train(self) -> None:
        s = self.spec
        with tinker.ServiceClient(api_key=s["api_key"], base_url=SPEC["base_url"]) as sc:
            tc = done(
                sc.create_lora_training_client(
                    base_model=s["base_model"], rank=s["rank"], seed=s["seed"]
                )
            )
            self.result["run"] = tc.model_id
            say("RUN", self.name, tc.model_id)
            self.ready.wait()
            step = 0
            while self.more(step):
                data = [datum(s["seed"], step, i, s["loss"]) for i in range(2)]
                fb = tc.forward_backward(data, s["loss"])
                opt = tc.optim_step(types.AdamParams(learning_rate=LR))
                self.op(fb_result(fb.result()))
                self.op(dict(opt.result().metrics or {}))
                if s["kind"] == "sampler":
                    sampler = done(tc.save_weights_and_get_sampling_client(name=f"s{step}"))
                    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=step)
                    prompt = types.ModelInput.from_ints(
                        [(31 * s["seed"] + 7 * step + 5 * j) % 200 + 1 for j in range(5)]
                    )
                    got = sampler.sample(prompt, 2, params).result()
                    self.op(
                        [
                            {"tokens": list(q.tokens), "logprobs": list(q.logprobs or [])}
                            for q in got.sequences
                        ]
                    )
                step += 1
            self.result["steps"] = step
            self.result["final"] = tc.save_state("final").result().path

    def job(self) -> None:
        s = self.spec
        headers = {"X-API-Key": s["api_key"]}
        with httpx.Client(base_url=SPEC["base_url"], headers=headers, timeout=60) as c:
            params = {**s["params"], "base_model": s["base_model"], "wait": "false"}
            r = c.post("/v1/lora/train-file-qa", params=params, json=s["pairs"])
            assert r.status_code == 200, r.text
            job_id = r.json()["jobId"]
            self.ready.wait()
            while True:  # through every fault: an error is retried, never a verdict
                try:
                    r = c.get(f"/v1/lora/jobs/{job_id}")
                    job = r.json() if r.status_code == 200 else {}
                except (httpx.HTTPError, ValueError):
                    job = {}
                if job.get("state") in ("succeeded", "failed", "cancelled"):
                    break
                time.sleep(0.5)
        keep = (
            "state",
            "error",
            "optimizerUpdateCount",
            "passCount",
            "finalTrainLoss",
            "initialLoss",
            "stopReason",
            "checkpoint",
            "runId",
        )
        self.op({k: job.get(k) for k in keep})
        self.result["run"] = job.get("runId")
        self.result["final"] = job.get("checkpoint")
        self.result["steps"] = job.get("optimizerUpdateCount")


def main() -> int:
    specs = SPEC["tenants"]
    ready = threading.Barrier(len(specs) + 1)
    tenants = [Tenant(s, ready) for s in specs]
    threads = [threading.Thread(target=t.run, name=t.name, daemon=True) for t in tenants]
    for t in threads:
        t.start()
    try:
        ready.wait()
        say("READY")
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    with open(OUT, "w") as f:
        json.dump({t.name: t.result for t in tenants}, f)
    return 1 if any("error" in t.result for t in tenants) else 0


if __name__ == "__main__":
    sys.exit(main())
