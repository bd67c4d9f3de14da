"""Managed training jobs through a real fleet on the tiny model (issue 13): juno's REST paths
in front, ledger operations on a trainer slot behind.

References: the greedy answer is generated in-process by transformers + PEFT from the job's
saved adapter folder; adapters are compared byte for byte (adapter_model.safetensors) with
the snapshot or the other job they must equal.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from lorafleet.testing import wait_until

pytestmark = pytest.mark.slow

FACT = {"Q": "What is my name?", "A": "Dima"}
FACTS = [
    {"Q": "What is my name?", "A": "Dima"},
    {"Q": "Where do I live?", "A": "Lisbon"},
    {"Q": "What is my cat called?", "A": "Tom"},
]
# One question, four answers: a held-out answer gets likelier while the model learns the
# format, then less likely as it memorises the others, so the validation loss rises.
CODE_WORDS = [
    {"Q": "What is the code word?", "A": w} for w in ("alpha", "bravo", "charlie", "delta")
]
NO_EARLY_STOP = {"loss_target": "0", "early_stop": "0"}


@contextlib.contextmanager
def client(fleet: Any, tenant: str | None = None) -> Iterator[httpx.Client]:
    """A client with its own tenant (so its own default run); on exit the default run is
    reset, which gives its trainer slot back to the fleet the tests share."""
    key = fleet.create_api_key(tenant or f"jobs-{uuid.uuid4().hex[:8]}", "test_jobs")
    with httpx.Client(base_url=fleet.base_url, headers={"X-API-Key": key}, timeout=600) as c:
        try:
            yield c
        finally:
            c.post("/v1/lora/reset")


def adapter_dir(fleet: Any, checkpoint: str) -> Path:
    """The saved state folder (a PEFT adapter folder) of a tinker://<run>/weights/<name>."""
    run, _, name = checkpoint.removeprefix("tinker://").partition("/weights/")
    return fleet.config.run_dir / "storage" / run / name


def adapter_bytes(fleet: Any, checkpoint: str) -> bytes:
    return (adapter_dir(fleet, checkpoint) / "adapter_model.safetensors").read_bytes()


def finished(c: httpx.Client, job_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        try:
            r = c.get(f"/v1/lora/jobs/{job_id}")
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        job = r.json()
        return job if job["state"] in ("succeeded", "failed", "cancelled") else None

    return wait_until(done, f"job {job_id} finished")


def bound_runs(fleet: Any) -> set[str]:
    """The training runs holding a trainer slot now (the controller's registry)."""
    from lorafleet.v1 import controller_pb2, controller_pb2_grpc

    with fleet.admin_channel() as ch:
        status = controller_pb2_grpc.ControllerServiceStub(ch).GetFleetStatus(
            controller_pb2.GetFleetStatusRequest(), timeout=60
        )
    return {reg.registration_id for rep in status.replicas for reg in rep.slots}


def greedy_answer(model_dir: Path, adapter: Path, question: str) -> str:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():
        out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, eos_token_id=end)
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()


def test_train_qa_teaches_a_fact_and_stops_on_target(shared_fleet, tiny_model_dir) -> None:
    with client(shared_fleet) as c:
        r = c.post(
            "/v1/lora/train-qa", params={"learning_rate": "0.01", "loss_target": "0.3"}, json=FACT
        )
        assert r.status_code == 200, r.text
        job = r.json()
    assert job["state"] == "succeeded"
    assert job["stopReason"] == "target_reached" and job["targetReached"] is True
    assert job["finalTrainLoss"] < 0.5 and job["lossGuidance"] == "reliable recall"
    assert (job["pairCount"], job["unitCount"], job["chatTemplate"]) == (1, 4, "chatml")
    assert job["optimizerUpdateCount"] == 4 * job["passCount"]
    assert job["runId"].endswith(":train:0") and job["checkpoint"].startswith("tinker://")
    adapter = adapter_dir(shared_fleet, job["checkpoint"])
    assert greedy_answer(tiny_model_dir, adapter, FACT["Q"]) == "Dima"


def test_a_second_job_continues_the_default_run_and_stops_at_once_below_target(
    shared_fleet,
) -> None:
    with client(shared_fleet) as c:
        params = {"learning_rate": "0.01", "loss_target": "0.3"}
        first = c.post("/v1/lora/train-qa", params=params, json=FACT).json()
        assert first["state"] == "succeeded"
        # a finished job's run gives its slot back at once (issue 26), not after the session
        # timeout (120 s) that freed it before: 30 s is slack for a loaded machine
        wait_until(
            lambda: first["runId"] not in bound_runs(shared_fleet), "slot released", within=30
        )
        again = c.post("/v1/lora/train-qa", params={"loss_target": "0.5"}, json=FACT).json()
        assert again["runId"] != first["runId"]  # a fresh run, resumed from first's state
        assert (again["optimizerUpdateCount"], again["passCount"]) == (0, 0)
        assert again["targetReached"] and again["initialLoss"] <= 0.5
        reset = c.post("/v1/lora/reset").json()
        assert reset["runId"] == again["runId"]
        fresh = c.post(
            "/v1/lora/train-qa", params={"max_iters": "1", **NO_EARLY_STOP}, json=FACT
        ).json()
        assert fresh["runId"] != first["runId"] and fresh["initialLoss"] > 1.0


def test_train_file_qa_counts_pairs_and_units_and_streams_progress(shared_fleet) -> None:
    facts = json.dumps(FACTS).encode()
    with client(shared_fleet) as c:
        r = c.post(
            "/v1/lora/train-file-qa",
            params={"wait": "false", "max_iters": "2", **NO_EARLY_STOP},
            files={"file": ("facts.json", facts, "application/json")},
        )
        assert r.status_code == 200, r.text
        assert r.json()["state"] in ("queued", "running")
        job_id = r.json()["jobId"]
        with c.stream("GET", f"/v1/lora/jobs/{job_id}/events") as stream:
            events = [line for line in stream.iter_lines() if line.startswith("event:")]
        job = finished(c, job_id)
    assert job["state"] == "succeeded", job
    assert (job["pairCount"], job["unitCount"], job["passCount"]) == (3, 12, 2)
    assert job["optimizerUpdateCount"] == 24 and job["stopReason"] == "max_iters"
    assert events[0] == "event: job" and events[-1] == "event: end"
    assert events.count("event: step") == 24 and events.count("event: pass") == 2
    assert [p["update"] for p in job["curve"]] == list(range(1, 25))


def test_seeded_jobs_give_byte_identical_adapters(shared_fleet) -> None:
    params = {"seed": "5", "max_iters": "2", "learning_rate": "0.005", **NO_EARLY_STOP}
    results = []
    for _ in range(2):
        with client(shared_fleet) as c:
            results.append(c.post("/v1/lora/train-file-qa", params=params, json=FACTS).json())
    a, b = results
    assert a["runId"] != b["runId"] and a["finalTrainLoss"] == b["finalTrainLoss"]
    assert adapter_bytes(shared_fleet, a["checkpoint"]) == adapter_bytes(
        shared_fleet, b["checkpoint"]
    )


def test_validation_split_restores_the_best_snapshot(shared_fleet) -> None:
    params = {
        "learning_rate": "0.01",
        "validation_split": "0.25",
        "validation_patience": "2",
        "max_iters": "8",
        "seed": "1",
        **NO_EARLY_STOP,
    }
    with client(shared_fleet) as c:
        job = c.post("/v1/lora/train-file-qa", params=params, json=CODE_WORDS).json()
    assert job["state"] == "succeeded", job
    assert (job["trainUnitCount"], job["validationUnitCount"]) == (12, 4)
    losses = {h["passNumber"]: h["validationLoss"] for h in job["history"]}
    best = job["bestPass"]
    assert job["stopReason"] == "patience" and best < job["passCount"]
    assert losses[best] == min(losses.values()) == job["bestValidationLoss"]
    assert max(losses[p] for p in losses if p > best) > losses[best]  # it rose after the best
    assert job["restoredCheckpoint"].endswith(f"-best-{best}")
    assert adapter_bytes(shared_fleet, job["checkpoint"]) == adapter_bytes(
        shared_fleet, job["restoredCheckpoint"]
    )
    # juno resets the optimizer with the best weights: the best snapshot kept its moments and
    # step count, the job's final state (what the next job on the run continues) has none.
    from safetensors.torch import load_file

    best, final = (adapter_dir(shared_fleet, job[k]) for k in ("restoredCheckpoint", "checkpoint"))
    steps = [
        json.loads((d / "trainer_state.json").read_text())["optim_steps"] for d in (best, final)
    ]
    moments = [len(load_file(d / "optimizer.safetensors")) for d in (best, final)]
    assert steps[0] > 0 and moments[0] > 0 and (steps[1], moments[1]) == (0, 0), (steps, moments)


def test_warmup_cosine_lr_follows_the_formula_per_update(shared_fleet) -> None:
    import math

    params = {
        "schedule": "warmup_cosine",
        "warmup_steps": "3",
        "min_lr": "0.001",
        "learning_rate": "0.01",
        "max_iters": "2",
        "gradient_accumulation": "3",
        **NO_EARLY_STOP,
    }
    with client(shared_fleet) as c:
        job = c.post("/v1/lora/train-file-qa", params=params, json=FACTS).json()
    total = job["maxUpdates"]
    assert total == 8 == job["optimizerUpdateCount"]  # 12 units / 3 per update, 2 passes
    for point in job["curve"]:
        u = point["update"]
        expected = (
            0.01 * u / 3
            if u <= 3
            else 0.001 + 0.009 * (1 + math.cos(math.pi * (u - 3) / (total - 3))) / 2
        )
        assert point["learningRate"] == pytest.approx(expected, rel=1e-12)


def test_bad_input_is_refused_naming_the_field_and_changes_nothing(shared_fleet) -> None:
    with client(shared_fleet) as c, client(shared_fleet) as other:
        trained = c.post(
            "/v1/lora/train-qa", params={"max_iters": "1", **NO_EARLY_STOP}, json=FACT
        ).json()
        before = c.post("/v1/lora/save", json={"name": "before"}).json()
        foreign = other.post("/v1/lora/save").json()["runId"]
        bad: list[tuple[str, dict[str, Any], str]] = [
            ("train-file-qa", {"json": []}, "pairs"),
            ("train-file-qa", {"json": [{"Q": "a"}]}, "body[0].A"),
            ("train-file-qa", {"json": [{"Q": "a", "A": 3}]}, "body[0].A"),
            ("train-file-qa", {"content": b"not json"}, "body"),
            ("train-file-qa", {"files": {"file": ("facts.txt", b"[]")}}, "file"),
            ("train-qa", {"json": FACT, "params": {"learnig_rate": "1"}}, "learnig_rate"),
            ("train-qa", {"json": FACT, "params": {"validation_split": "1"}}, "validation_split"),
            ("train-qa", {"json": FACT, "params": {"learning_rate": "0"}}, "learning_rate"),
            ("train-qa", {"json": FACT, "params": {"rank": "4"}}, "rank"),  # shape of the run
            (
                "train",
                {"json": {"text": "words"}, "params": {"chunk_tokens": "1"}},
                "chunk_tokens",
            ),
            (
                "train-qa",
                {"json": FACT, "params": {"run": "session-x:train:0"}},
                "registration_id",
            ),
            ("train-qa", {"json": FACT, "params": {"run": foreign}}, "registration_id"),
        ]
        for route, kwargs, field in bad:
            r = c.post(f"/v1/lora/{route}", **kwargs)
            expected = 404 if field == "registration_id" else 400
            assert (r.status_code, r.json()["field"]) == (expected, field), (route, r.text)
        after = c.post("/v1/lora/save", json={"name": "after"}).json()
        kinds = [j["kind"] for j in c.get("/v1/lora/jobs").json()["jobs"]]
    # each job's run gave its slot back; the next resumed its final state on a fresh run
    assert len({after["runId"], before["runId"], trained["runId"]}) == 3
    assert kinds == ["save", "save", "qa"]  # nothing else was ever created
    assert adapter_bytes(shared_fleet, after["checkpoint"]) == adapter_bytes(
        shared_fleet, before["checkpoint"]
    )


def test_cancel_stops_a_job(shared_fleet) -> None:
    with client(shared_fleet) as c:
        job_id = c.post(
            "/v1/lora/train-qa", params={"wait": "false", **NO_EARLY_STOP}, json=FACT
        ).json()["jobId"]
        wait_until(lambda: c.get(f"/v1/lora/jobs/{job_id}").json()["updates"] >= 2, "training")
        assert c.post(f"/v1/lora/jobs/{job_id}/cancel").status_code == 200
        job = finished(c, job_id)
        assert job["state"] == "cancelled" and job["updates"] < 200
        with client(shared_fleet) as other:
            assert other.get(f"/v1/lora/jobs/{job_id}").status_code == 404


def test_a_job_survives_a_controller_sigkill_with_the_same_adapter(make_fleet) -> None:
    params = {"seed": "11", "max_iters": "4", "learning_rate": "0.005", **NO_EARLY_STOP}
    with make_fleet(slots=2) as fleet:
        with client(fleet) as c:
            reference = c.post("/v1/lora/train-file-qa", params=params, json=FACTS).json()
        with client(fleet) as c:
            job_id = c.post(
                "/v1/lora/train-file-qa", params={**params, "wait": "false"}, json=FACTS
            ).json()["jobId"]
            wait_until(
                lambda: c.get(f"/v1/lora/jobs/{job_id}").json()["updates"] >= 18,
                "mid-job (second pass)",
            )
            member = fleet.member("controller")
            pid = member.proc.pid
            os.kill(pid, signal.SIGKILL)
            wait_until(lambda: member.proc.pid != pid, "controller restarted")
            job = finished(c, job_id)
        assert job["state"] == "succeeded", job
        assert job["optimizerUpdateCount"] == reference["optimizerUpdateCount"] == 48
        assert job["finalTrainLoss"] == reference["finalTrainLoss"]
        assert adapter_bytes(fleet, job["checkpoint"]) == adapter_bytes(
            fleet, reference["checkpoint"]
        )


def test_cli_trains_a_fact_with_progress_and_saves_the_curve(shared_fleet, tmp_path) -> None:
    key = shared_fleet.create_api_key(f"jobs-cli-{uuid.uuid4().hex[:8]}", "test_jobs")
    env = {**os.environ, "TINKER_BASE_URL": shared_fleet.base_url, "TINKER_API_KEY": key}
    cli = [sys.executable, "-m", "lorafleet_cli.main"]
    run = subprocess.run(
        [
            *cli,
            "train",
            "qa",
            FACT["Q"],
            FACT["A"],
            "-p",
            "learning_rate=0.01",
            "-p",
            "loss_target=0.3",
            "--curve",
            str(tmp_path / "curve"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert "stopReason: target_reached" in run.stdout and "pairCount: 1" in run.stdout
    assert "update" in run.stderr  # the progress bar
    rows = (tmp_path / "curve.csv").read_text().splitlines()
    job_id = run.stdout.split()[1]
    assert rows[0] == "update,pass,loss,learning_rate" and len(rows) > 1
    shown = subprocess.run(
        [*cli, "jobs", "show", job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "succeeded" in shown.stdout
    listed = subprocess.run(
        [*cli, "jobs", "list"], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert job_id in listed.stdout
    subprocess.run([*cli, "jobs", "cancel", job_id], env=env, timeout=60, check=True)
    httpx.post(f"{shared_fleet.base_url}/v1/lora/reset", headers={"X-API-Key": key})


def test_train_file_trains_a_document_in_bptt_windows(shared_fleet, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    sentence = (
        "The lighthouse keeper of Ardmore counts the ships every evening. "
        "She writes their names in a blue book and rings the bell twice at dusk. "
    )
    text = sentence * 3
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    n_tokens = len(tok.encode(text, add_special_tokens=False))
    params = {"chunk_tokens": "16", "max_iters": "3", "learning_rate": "0.005", **NO_EARLY_STOP}
    with client(shared_fleet) as c:
        r = c.post(
            "/v1/lora/train-file",
            params=params,
            files={"file": ("notes.txt", text.encode(), "text/plain")},
        )
        job = r.json()
        plain = c.post(
            "/v1/lora/train", params={**params, "max_iters": "1"}, json={"text": text}
        ).json()
    assert job["state"] == "succeeded", job
    assert (job["documentCount"], job["unitCount"]) == (1, 1)
    assert job["chunkCount"] == -(-(n_tokens - 1) // 16) == job["optimizerUpdateCount"] // 3
    assert job["finalTrainLoss"] < job["initialLoss"] and "pairCount" not in job
    assert plain["state"] == "succeeded"
    assert plain["initialLoss"] < job["initialLoss"]  # resumes the run already trained on it


def test_lorafleet_train_qa_file_runs_a_job_and_jobs_show_reads_it(shared_fleet, tmp_path) -> None:
    """The CLI as the README runs it: `lorafleet train qa-file facts.json -p ...` uploads the
    file, follows the job to its end and prints its result and loss curve; `lorafleet jobs
    show` reads the same job; a missing file is refused before anything is sent."""
    key = shared_fleet.create_api_key(f"cli-{uuid.uuid4().hex[:8]}", "test_jobs")
    env = {**os.environ, "TINKER_BASE_URL": shared_fleet.base_url, "TINKER_API_KEY": key}
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps(FACTS))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "lorafleet_cli.main", *args]
        return subprocess.run(
            argv, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
        )

    params = ["-p", "max_iters=2", "-p", "loss_target=0", "-p", "early_stop=0"]
    done = cli("train", "qa-file", str(facts), *params)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0].split()
    assert first[0] == "job" and first[2] == "succeeded", done.stdout
    job_id = first[1]
    assert "  pairCount: 3" in done.stdout and "  passCount: 2" in done.stdout, done.stdout
    curve = next(line for line in done.stdout.splitlines() if "loss curve:" in line)
    assert Path(tmp_path, curve.split("loss curve: ")[1]).is_file(), curve
    shown = cli("jobs", "show", job_id)
    assert shown.returncode == 0 and shown.stdout.splitlines()[0] == done.stdout.splitlines()[0]
    missing = cli("train", "qa-file", str(tmp_path / "nope.json"))
    assert missing.returncode == 1 and "no file" in missing.stderr, missing.stderr
    # The CLI's tenant trained its default run: give its slot back to the fleet the tests share.
    headers = {"X-API-Key": key}
    with httpx.Client(base_url=shared_fleet.base_url, headers=headers, timeout=60) as c:
        assert c.post("/v1/lora/reset").status_code == 200
