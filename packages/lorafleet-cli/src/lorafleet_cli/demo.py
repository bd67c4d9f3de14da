"""`lorafleet demo` (what `make demo` runs): fleet up, the quickstart through the SDK, a managed
training job, fleet down.

The quickstart runs in the tinker SDK's own venv (`.venvs/tinker-0.38.0`), exactly as a user's
laptop would, talking HTTP to the gateway. Then `lorafleet train qa-file` teaches two facts
with one request (no training loop on the client) and the SDK asks both questions of the
job's checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from lorafleet_cli import runs
from lorafleet_cli.fleet import Fleet, FleetConfig, FleetError
from lorafleet_cli.models import resolve_model

REPO = Path(__file__).resolve().parents[4]
SDK_PYTHON = REPO / ".venvs" / "tinker-0.38.0" / "bin" / "python"


# The managed path: one juno-style job teaches two facts, then the SDK asks both.
FACTS = (("What is my name?", "Dima"), ("Where do I live?", "Lisbon"))
JOB_PARAMS = ("learning_rate=0.002", "loss_target=0.3", "max_iters=30")


def _managed_job(run_dir: Path, env: dict[str, str]) -> int:
    """`lorafleet train qa-file` on FACTS, then examples/ask.py on the job's checkpoint."""
    facts = run_dir / "facts.json"
    facts.write_text(json.dumps([{"Q": q, "A": a} for q, a in FACTS]))
    params = [arg for p in JOB_PARAMS for arg in ("-p", p)]
    print("lorafleet: managed job: lorafleet train qa-file facts.json", file=sys.stderr)
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "lorafleet_cli.main",
            "train",
            "qa-file",
            str(facts),
            *params,
            "--curve",
            str(run_dir / "job-loss"),
        ],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    print(job.stdout, end="")
    paths = [line.split()[-1] for line in job.stdout.splitlines() if "checkpoint:" in line]
    if job.returncode != 0 or not paths:
        print(job.stderr, end="", file=sys.stderr)
        return job.returncode or 1
    expect = [f"{q}={a}" for q, a in FACTS]
    return subprocess.call(
        [str(SDK_PYTHON), str(REPO / "examples" / "ask.py"), paths[-1], *expect], env=env
    )


def run_demo(model: str) -> int:
    started = time.monotonic()
    if not SDK_PYTHON.exists():
        print(
            f"lorafleet: the SDK venv is missing ({SDK_PYTHON}); run `make demo`", file=sys.stderr
        )
        return 1
    try:
        model_path = resolve_model(model)
    except FleetError as exc:
        print(f"lorafleet: {exc}", file=sys.stderr)
        return 1
    run_dir = runs.new_run_dir()
    print(f"lorafleet: model {model_path}; run folder {run_dir}", file=sys.stderr)
    try:
        with Fleet(FleetConfig(model_path=model_path, run_dir=run_dir, slots=4)) as fleet:
            print(
                f"lorafleet: fleet up in {time.monotonic() - started:.1f}s at {fleet.base_url}",
                file=sys.stderr,
            )
            env = dict(
                os.environ,
                TINKER_BASE_URL=fleet.base_url,
                TINKER_API_KEY=fleet.api_key,
                TINKER_TELEMETRY="0",
                HF_HUB_OFFLINE="1",
                QUICKSTART_PLOT=str(run_dir / "loss_curve.png"),
            )
            rc = subprocess.call(
                [str(SDK_PYTHON), str(REPO / "examples" / "quickstart.py")], env=env
            )
            if rc == 0:
                rc = _managed_job(run_dir, env)
    except FleetError as exc:
        print(f"lorafleet: {exc}", file=sys.stderr)
        return 1
    print(
        f"lorafleet: demo finished in {time.monotonic() - started:.1f}s (exit {rc})",
        file=sys.stderr,
    )
    return rc
