#!/usr/bin/env bash
# Build the real-SDK compatibility venvs used by tests/sdk (tinker-api.md §12):
#   .venvs/tinker-0.24.1  tinker 0.24.1 (transformers for get_tokenizer; no torch: the SDK
#                         only needs it for TensorData.from_torch, which the scripts avoid)
#   .venvs/tinker-0.38.0  tinker 0.38.0 + torch (CPU wheel, pinned so nothing pulls CUDA),
#                         matplotlib (the quickstart's loss curve) and
#                         tinker-cookbook 0.6.1. The cookbook declares tml-renderers>=0.4.1, which
#                         no registry we reach publishes (newest: 0.2.1), so it is installed with
#                         --no-deps next to its other dependencies; tests/sdk checks that the
#                         recipes it runs import.
# Idempotent: a venv whose marker file exists is left alone. Usage: tests/sdk/setup_venvs.sh [0.24.1|0.38.0]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}

build() {  # build VERSION PACKAGES...
  local version=$1; shift
  local dir=.venvs/tinker-$version
  if [[ -f $dir/.installed ]]; then echo "$dir: already built"; return; fi
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  "$dir/bin/pip" install -q "$@"
  touch "$dir/.installed"
  echo "$dir: built ($("$dir/bin/python" -c 'import tinker; print(tinker.__version__)'))"
}

want=${1:-all}
if [[ $want == all || $want == 0.24.1 ]]; then
  build 0.24.1 tinker==0.24.1 transformers==5.24.0 tokenizers==0.23.3
fi
if [[ $want == all || $want == 0.38.0 ]]; then
  # torch pinned in the same resolve, so the resolver never considers a CUDA build (platform.md §1).
  # matplotlib: examples/quickstart.py draws its loss curve (make demo runs it in this venv).
  build 0.38.0 torch==2.13.0 tinker==0.38.0 transformers==5.24.0 tokenizers==0.23.3 \
    matplotlib==3.11.2
  dir=.venvs/tinker-0.38.0
  if [[ ! -f $dir/.cookbook ]]; then
    "$dir/bin/pip" install -q torch==2.13.0 transformers==5.24.0 aiohttp anyio blobfile chz \
      cloudpickle datasets huggingface-hub pillow pydantic pyrage rich safetensors termcolor \
      tiktoken tqdm sympy math-verify pylatexenc
    "$dir/bin/pip" install -q --no-deps tinker-cookbook==0.6.1
    touch "$dir/.cookbook"
    echo "$dir: tinker-cookbook 0.6.1 installed"
  fi
fi
