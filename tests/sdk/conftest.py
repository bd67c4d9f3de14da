"""Fixtures for the real-SDK tier: one fleet per module, the gateways, and a runner.

The SDK runs in its own venv (built by tests/sdk/setup_venvs.sh), as a separate process
talking HTTP to the gateway, exactly like a user's script. Tests skip with the command to
run when a venv is missing.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from lorafleet.testing import child_env, free_port, stop_process, wait_for_port

HERE = Path(__file__).resolve().parent
SMOKE = "SMOKE OK "


@dataclass
class Target:
    """A gateway an SDK process talks to."""

    base_url: str
    api_key: str
    base_model: str
    model_dir: Path

    def env(self, **extra: str) -> dict[str, str]:
        return child_env(
            TINKER_BASE_URL=self.base_url,
            TINKER_API_KEY=self.api_key,
            SMOKE_BASE_MODEL=self.base_model,
            MODEL_DIR=str(self.model_dir),
            **extra,
        )

    def get(self, path: str, **kw: object) -> httpx.Response:
        headers = {"X-API-Key": self.api_key}
        return httpx.get(f"{self.base_url}{path}", headers=headers, timeout=60, **kw)


@pytest.fixture(scope="module")
def run_sdk(sdk_python: Callable[[str], Path]) -> Callable[..., dict]:
    """run_sdk(version, script, target, **env) → the script's result JSON (asserts success)."""

    def run(version: str, script: str, target: Target, timeout: float = 600, **env: str) -> dict:
        """Run tests/sdk/<script> with that SDK; return the JSON after its "SMOKE OK " line."""
        proc = subprocess.run(
            [str(sdk_python(version)), "-W", "error::FutureWarning", str(HERE / script)],
            env=target.env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(SMOKE)]
        assert proc.returncode == 0 and lines, f"{script} with tinker {version} failed:\n" + (
            proc.stdout[-4000:] + proc.stderr[-8000:]
        )
        return json.loads(lines[-1][len(SMOKE) :])

    return run


@pytest.fixture(scope="module")
def fleet(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    # registrations keep their slot after a session ends; ~9 runs here
    with make_fleet(trainers=1, rollouts=1, slots=16) as running:
        yield running


@pytest.fixture(scope="module")
def target(fleet: object, tiny_model_dir: Path) -> Target:
    key = fleet.api_key  # type: ignore[attr-defined]
    caps = httpx.get(
        f"{fleet.base_url}/api/v1/get_server_capabilities",  # type: ignore[attr-defined]
        headers={"X-API-Key": key},
        timeout=30,
    ).json()
    name = caps["supported_models"][0]["model_name"]
    return Target(fleet.base_url, key, name, tiny_model_dir)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def json_target(fleet: object, target: Target, tmp_path_factory: pytest.TempPathFactory):
    """A second gateway on the same controller serving client/config {} (0.24.1 → JSON)."""
    port = free_port()
    log = tmp_path_factory.mktemp("gateway-json") / "gateway.log"
    env = child_env(
        LORAFLEET_GATEWAY_PORT=str(port),
        LORAFLEET_GATEWAY_CONTROLLER_ADDRESS=fleet.controller_address,  # type: ignore[attr-defined]
        LORAFLEET_GATEWAY_PROTO_FLAGS="false",
        **fleet.client_env("gateway"),  # type: ignore[attr-defined]
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lorafleet_gateway"], env=env, stdout=out, stderr=out
        )
    try:
        wait_for_port(port, proc=proc)
        yield Target(
            f"http://127.0.0.1:{port}", target.api_key, target.base_model, target.model_dir
        )
    finally:
        stop_process(proc)


def _peft_logprobs(model_dir: Path, adapter_dir: Path, ids: list[int]) -> list[float]:
    """Per-token logprobs of ids[1:] given ids[:-1], with transformers + PEFT in-process."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def _download_adapter(target: Target, run_id: str, checkpoint_id: str, dest: Path) -> set[str]:
    """0.24.1's archive route: a signed URL, fetched without the API key, holding a tar."""
    reply = target.get(f"/api/v1/training_runs/{run_id}/checkpoints/{checkpoint_id}/archive")
    assert reply.status_code == 200, reply.text
    tar_bytes = httpx.get(reply.json()["url"], timeout=60)
    assert tar_bytes.status_code == 200, tar_bytes.text
    with tarfile.open(fileobj=io.BytesIO(tar_bytes.content)) as tar:
        tar.extractall(dest, filter="data")
        return {m.name for m in tar.getmembers()}


@pytest.fixture(scope="session")
def peft_logprobs() -> Callable[[Path, Path, list[int]], list[float]]:
    """peft_logprobs(model_dir, adapter_dir, ids): the in-process reference."""
    return _peft_logprobs


@pytest.fixture(scope="session")
def download_adapter() -> Callable[[Target, str, str, Path], set[str]]:
    """download_adapter(target, run_id, checkpoint_id, dest) → the tar's member names."""
    return _download_adapter


def _sampler_matches_trainer(out: dict, tol: float) -> float:
    """Check sglang_script.py's report: every sampled logprob and the sampler's
    compute_logprobs of prompt + sample equal the trainer's forward logprobs of the same
    tokens within `tol`. Returns the largest difference seen."""
    n_prompt = len(out["prompt"])
    worst = 0.0
    for name, sequences in out["samples"].items():
        assert len(sequences) == 2, name
        for seq in sequences:
            n = len(seq["tokens"])
            assert n == len(seq["logprobs"]) > 0, name
            trainer = seq["trainer_logprobs"]  # log p(full[t+1] | full[:t+1])
            assert len(trainer) == n_prompt + n - 1
            assert seq["logprobs"] == pytest.approx(trainer[n_prompt - 1 :], abs=tol), name
            prompt_lps = seq["sampler_prompt_logprobs"]
            assert prompt_lps[0] is None
            assert prompt_lps[1:] == pytest.approx(trainer, abs=tol), name
            got, want = [*seq["logprobs"], *prompt_lps[1:]], [*trainer[n_prompt - 1 :], *trainer]
            pairs = zip(got, want, strict=True)
            worst = max(worst, *(abs(a - b) for a, b in pairs))
    return worst


@pytest.fixture(scope="session")
def sampler_matches_trainer() -> Callable[[dict, float], float]:
    """sampler_matches_trainer(sglang_script.py's report, tol) → the largest difference."""
    return _sampler_matches_trainer
