"""How lorafleet starts a real SGLang server: the one place its command line and environment live.

Used by the real-server test tier and by `lorafleet up --engine sglang`, so CI serves through
exactly what an operator runs. SGLang runs in its own interpreter (`.venvs/sglang`, made by
`services/rollout/tests/setup_sglang_venv.sh`; on a GPU machine, whatever Python has the CUDA
SGLang stack), never in ours: it pins another torch and transformers.

Two launch profiles (platform.md §4.2):

* `cuda`: LoRA serving as on a GPU cluster.
* `cpu`: SGLang's CPU backend (`--device cpu` and SGLANG_USE_CPU_ENGINE=1), torch-native
  attention, sampling and LoRA, float32, with `services/rollout/sglang_cpu_shims` on the
  server's PYTHONPATH (stand-ins for the CUDA kernel wheel and torchvision, and pin_memory
  made a no-op). `--sleep-on-idle` because the idle scheduler otherwise spins a whole core.

Both set SGLANG_RETURN_ORIGINAL_LOGPROB=1: without it SGLang reports logprobs of the
temperature-scaled distribution, and RL losses need the model's own (the trainer's).
`lm_head` is always a LoRA target because the SDK's default `train_unembed=True` puts it in
every adapter, and a server without it refuses them.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from lorafleet import quantize
from lorafleet_rollout import sglang_api

_ROLLOUT_ROOT = Path(__file__).resolve().parents[2]
#: Stand-ins SGLang's CPU path needs (see their README); on the server's PYTHONPATH only.
CPU_SHIMS = _ROLLOUT_ROOT / "sglang_cpu_shims"
#: Where setup_sglang_venv.sh puts the CPU SGLang interpreter (a repo checkout's .venvs).
DEFAULT_PYTHON = _ROLLOUT_ROOT.parents[1] / ".venvs" / "sglang" / "bin" / "python"
#: Every projection our trainer adapts on dense models, and lm_head (train_unembed).
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "lm_head",
)

Device = Literal["cpu", "cuda"]


def default_device() -> Device:
    """cuda where an NVIDIA driver is installed, else SGLang's CPU backend."""
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


@dataclass(frozen=True)
class SGLangServer:
    """One SGLang server process's launch: `command()` and `env()` are all of it."""

    model_path: Path
    port: int
    host: str = "127.0.0.1"
    python: Path = DEFAULT_PYTHON
    device: Device = "cpu"
    max_lora_rank: int = 64
    max_loras_per_batch: int = 8
    max_loaded_loras: int = 16
    #: cpu only: KV-cache tokens and concurrent requests (SGLang sizes them from GPU memory
    #: otherwise, and on a CPU it would take most of the machine's RAM).
    max_total_tokens: int = 8192
    max_running_requests: int = 16
    #: The fleet's base quantization (lorafleet.quantize); SGLang quantizes at load.
    quantization: str = quantize.NONE

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        args = [
            str(self.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model_path),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--enable-lora",
            "--max-lora-rank",
            str(self.max_lora_rank),
            "--lora-target-modules",
            *LORA_TARGETS,
            "--max-loras-per-batch",
            str(self.max_loras_per_batch),
            "--max-loaded-loras",
            str(self.max_loaded_loras),
            "--sleep-on-idle",
        ]
        if self.quantization != quantize.NONE:
            args += ["--quantization", quantize.ENGINE_FLAGS[self.quantization]]
        if self.device == "cpu":
            args += [
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--attention-backend",
                "torch_native",
                "--sampling-backend",
                "pytorch",
                "--lora-backend",
                "torch_native",
                "--max-total-tokens",
                str(self.max_total_tokens),
                "--max-running-requests",
                str(self.max_running_requests),
            ]
        return args

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", SGLANG_RETURN_ORIGINAL_LOGPROB="1")
        if self.device == "cpu":
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(
                p for p in (str(CPU_SHIMS), env.get("PYTHONPATH", "")) if p
            )
        return env

    def check(self) -> None:
        """Fail at once, naming what is missing, rather than after a start-up timeout."""
        if not self.python.exists():
            hint = " (run services/rollout/tests/setup_sglang_venv.sh)"
            raise FileNotFoundError(
                f"no SGLang interpreter at {self.python}{hint if self.device == 'cpu' else ''}"
            )
        if self.quantization != quantize.NONE and self.quantization not in quantize.ENGINE_FLAGS:
            raise ValueError(
                f"quantization {self.quantization!r}: SGLang serves "
                f"{', '.join(quantize.ENGINE_FLAGS)} (the torch engine serves every setting)"
            )
        config = self.model_path / "config.json"
        if not config.exists():
            raise FileNotFoundError(f"model_path {self.model_path} has no config.json")
        if self.device == "cpu" and _is_moe(json.loads(config.read_text())):
            raise ValueError(
                f"model_path {self.model_path} is a mixture-of-experts model, which SGLang "
                f"{sglang_api.SGLANG_VERSION}'s CPU backend cannot serve with LoRA: its LoRA MoE "
                "layer runs the experts through Triton kernels (srt/lora/layers.py "
                "_forward_with_lora -> moe_runner/triton.py), which need a GPU; the scheduler "
                "dies on the first batch. Use the torch engine, or SGLang on a GPU"
            )

    def start(self, log: Path) -> subprocess.Popen[bytes]:
        """Start the server in its own session (its scheduler and detokenizer children share
        the process group, so `stop` reaches them by the leader's PID)."""
        self.check()
        with log.open("ab") as out:
            return subprocess.Popen(
                self.command(),
                env=self.env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
        """Poll /health until 200; raise with the log's tail if the server exits or the
        deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"SGLang exited with {proc.returncode} during start-up: {_tail(log)}"
                )
            try:
                with urllib.request.urlopen(self.url + sglang_api.HEALTH, timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, http.client.HTTPException, OSError):
                pass  # not listening yet, or answering 503 while its health generate runs
            time.sleep(0.5)
        raise TimeoutError(f"SGLang at {self.url} not healthy after {timeout:.0f}s: {_tail(log)}")


def _is_moe(config: dict[str, object]) -> bool:
    """Experts per layer in any of the names HF configs use (Qwen-MoE, Mixtral, DeepSeek)."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = config.get(key)
        if isinstance(value, int) and value > 1:
            return True
    return False


def stop(proc: subprocess.Popen[bytes], grace: float = 20.0) -> int | None:
    """SIGTERM the server (it drains and takes its scheduler and detokenizer down with it),
    then SIGKILL its whole process group (the leader's PID) after `grace` and for leftovers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(10)
    _signal_group(proc, signal.SIGKILL)
    return proc.returncode


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _tail(log: Path, lines: int = 15) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()[-lines:]
    except FileNotFoundError:
        return "no log"
    return " | ".join(text) or "no output"
