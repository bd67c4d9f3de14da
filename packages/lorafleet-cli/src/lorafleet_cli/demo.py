"""`lorafleet demo` (what `make demo` runs): fleet up, the quickstart through the SDK, fleet down.

The quickstart runs in the tinker SDK's own venv (`.venvs/tinker-0.38.0`), exactly as a user's
laptop would, talking HTTP to the gateway.
"""

from __future__ import annotations

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


def run_demo(model: str) -> int:
    started = time.monotonic()
    if not SDK_PYTHON.exists():
        print(f"lorafleet: the SDK venv is missing ({SDK_PYTHON}); run `make demo`",
              file=sys.stderr)  # fmt: skip
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
            print(f"lorafleet: fleet up in {time.monotonic() - started:.1f}s at {fleet.base_url}",
                  file=sys.stderr)  # fmt: skip
            env = dict(os.environ, TINKER_BASE_URL=fleet.base_url, TINKER_API_KEY=fleet.api_key,
                       TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1",
                       QUICKSTART_PLOT=str(run_dir / "loss_curve.png"))  # fmt: skip
            rc = subprocess.call(
                [str(SDK_PYTHON), str(REPO / "examples" / "quickstart.py")], env=env
            )
    except FleetError as exc:
        print(f"lorafleet: {exc}", file=sys.stderr)
        return 1
    print(f"lorafleet: demo finished in {time.monotonic() - started:.1f}s (exit {rc})",
          file=sys.stderr)  # fmt: skip
    return rc
