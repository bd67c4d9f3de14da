"""Bad LoRA input through a real tinker SDK: refused at once, or failed at once, never hung.

Run by tests/sdk/test_validation.py with each SDK venv's python against a fleet with two
trainer slots (env as compat_script.py, plus OTHER_API_KEY: a second tenant's key):
1. another tenant's run takes a slot and trains, a filler run takes the other;
2. an unknown target name is a 400 naming it (and the valid names) at create time, for a
   training client and for a managed job;
3. a run the trainer will refuse (its exclude list leaves no module) is admitted and queued,
   with a forward_backward waiting on it, and a second such run carries managed jobs: one
   cancelled while it waits, one waiting when the slot frees;
4. the filler is unloaded: the refused bind fails both runs, the SDK future and the job end
   with the trainer's error, later calls too, and the other tenant's run trains on.
It prints one JSON line starting with "SMOKE OK" with the timings and messages to check.
"""

import json
import os
import threading
import time

import httpx
import tinker
from tinker import types

NEW = not tinker.__version__.startswith("0.24")
BASE = os.environ["SMOKE_BASE_MODEL"]
URL = os.environ["TINKER_BASE_URL"]
KEY = os.environ["TINKER_API_KEY"]
FACT = {"Q": "What is my name?", "A": "Dima"}
# all-linear minus every linear module of the tiny model: nothing left to adapt, which only
# the trainer can tell (the names themselves are all valid)
EVERYTHING = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
REFUSED = {"lorafleet.target_modules": "all-linear", "lorafleet.exclude_modules": EVERYTHING}
FINAL = ("succeeded", "failed", "cancelled")
DEADLINE = 120.0


def done(x):
    """0.38's create_* calls return futures; 0.24.1's return the object."""
    return x.result() if NEW else x


def failure(call) -> tuple[float, str]:
    """(seconds, error text) of a call that must raise."""
    t0 = time.monotonic()
    try:
        call()
    except Exception as exc:  # the SDK's error types differ between versions
        return time.monotonic() - t0, f"{type(exc).__name__}: {exc}"
    raise AssertionError("the call succeeded")


def http() -> httpx.Client:
    return httpx.Client(base_url=URL, headers={"X-API-Key": KEY}, timeout=DEADLINE)


def job_end(job_id: str) -> dict:
    """The job's final view, from its server-sent events (pushed, no polling)."""
    with http() as c, c.stream("GET", f"/v1/lora/jobs/{job_id}/events") as events:
        event = ""
        for line in events.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: ") and event in ("job", "end"):
                view = json.loads(line.removeprefix("data: "))
                if view["state"] in FINAL:
                    return view
    raise AssertionError(f"job {job_id}'s events ended before it did")


def running_job(run_id: str) -> str:
    """Create a QA job on the run (not waiting) and return its id once it runs."""
    with http() as c:
        job = c.post("/v1/lora/train-qa", params={"run": run_id, "wait": "false"}, json=FACT)
        assert job.status_code == 200, job.text
        job_id = job.json()["jobId"]
        deadline = time.monotonic() + DEADLINE
        while c.get(f"/v1/lora/jobs/{job_id}").json()["state"] != "running":
            assert time.monotonic() < deadline, f"job {job_id} never started"
            time.sleep(0.05)
    return job_id


class Ending(threading.Thread):
    """Waits for a job's end beside the caller; `at` is when it saw it."""

    def __init__(self, job_id: str) -> None:
        super().__init__(daemon=True)
        self.job_id, self.view, self.at = job_id, {}, 0.0
        self.start()

    def run(self) -> None:
        self.view = job_end(self.job_id)
        self.at = time.monotonic()


def main() -> None:
    sc = tinker.ServiceClient()
    other = tinker.ServiceClient(api_key=os.environ["OTHER_API_KEY"])
    out: dict = {}

    with http() as c:  # a managed job's targets are checked the same way, before anything
        t0 = time.monotonic()
        job = c.post("/v1/lora/train-qa", params={"targets": "wq,wv", "wait": "false"}, json=FACT)
        out["job_unknown_s"], out["job_unknown"] = time.monotonic() - t0, job.json()
        out["job_unknown"]["status"] = job.status_code

    keep = done(other.create_lora_training_client(BASE, rank=4))
    ids = keep.get_tokenizer().encode("The capital of France is Paris.")
    d = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    out["other_before"] = keep.forward_backward([d], "cross_entropy").result().metrics["loss:sum"]
    keep.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    filler = done(sc.create_lora_training_client(BASE, rank=4))
    # (after the client's first create: its lazy imports and connection are not the server's)
    unknown = {"lorafleet.target_modules": "wq,v_proj,wv"}
    out["unknown_s"], out["unknown"] = failure(
        lambda: done(sc.create_lora_training_client(BASE, rank=4, user_metadata=unknown))
    )

    bad = done(sc.create_lora_training_client(BASE, rank=4, user_metadata=REFUSED))
    waiting = bad.forward_backward([d], "cross_entropy")
    jobs_run = done(sc.create_lora_training_client(BASE, rank=4, user_metadata=REFUSED))

    cancelled = Ending(running_job(jobs_run.model_id))
    with http() as c:
        t0 = time.monotonic()
        c.post(f"/v1/lora/jobs/{cancelled.job_id}/cancel").raise_for_status()
    cancelled.join(DEADLINE)
    out["cancel_s"], out["cancelled"] = cancelled.at - t0, cancelled.view

    failing = Ending(running_job(jobs_run.model_id))
    with http() as c:
        t0 = time.monotonic()
        c.post("/api/v1/unload_model", json={"model_id": filler.model_id}).raise_for_status()
    out["future_s"], out["future"] = failure(waiting.result)
    out["future_s"] = time.monotonic() - t0
    failing.join(DEADLINE)
    out["job_s"], out["job"] = failing.at - t0, failing.view
    out["later_s"], out["later"] = failure(
        lambda: bad.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    )

    keep.forward_backward([d], "cross_entropy").result()
    keep.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    out["other_after"] = keep.forward([d], "cross_entropy").result().metrics["loss:sum"]
    print("SMOKE OK " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
