#!/usr/bin/env bash
# Create .venvs/sglang for the slow real-SGLang-on-CPU tier (platform.md §4.2): 3.5 GB; 4.5-8 min on a busy
# 2-core machine, about the same with the wheelhouse below (unpacking, not downloading, dominates).
# sglang 0.5.23 requires a CUDA torch 2.14.1 and a CUDA-only kernel stack, none of which loads or
# is needed on its CPU backend. So: the CPU torch wheel, sglang without its dependencies, then its
# non-extra requirements read from the installed METADATA minus the CUDA-only ones, under a
# torch==2.13.0 constraint so nothing pulls the CUDA torch back in. The three stand-ins SGLang's
# CPU path still needs (sgl_kernel, torchvision, sitecustomize) live in
# services/rollout/sglang_cpu_shims/ and go on the server's PYTHONPATH only
# (lorafleet_rollout.sglang_server), never into this venv.
# Wheels are kept in a wheelhouse between installs (CI on a clean clone of this machine):
# pip's own HTTP cache stores nothing on these machines, so the second install is offline from
# ~/.cache/lorafleet/wheels/sglang-<version> (LORAFLEET_WHEELHOUSE moves it).
set -euo pipefail
cd "$(dirname "$0")/../../.."
SGLANG=0.5.23
WHEELS=${LORAFLEET_WHEELHOUSE:-$HOME/.cache/lorafleet/wheels}/sglang-$SGLANG
if [[ -n ${LORAFLEET_SGLANG_VENV:-} ]]; then  # an explicit (throwaway) venv, built in place
  VENV=$LORAFLEET_SGLANG_VENV
  LINK=
  if [[ -f $VENV/.installed ]] && $VENV/bin/python -c \
    "from importlib.metadata import version; assert version('sglang') == '$SGLANG'" 2>/dev/null; then
    echo "$VENV is ready"
    exit 0
  fi
else  # .venvs/sglang links the machine's cached venv of this recipe (tests/cached_venv.sh)
  # shellcheck source=../../../tests/cached_venv.sh
  source tests/cached_venv.sh
  if cached_venv sglang services/rollout/tests/setup_sglang_venv.sh; then exit 0; fi
  LINK=sglang
fi
mkdir -p "$WHEELS"
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0  # the CPU wheel on the machine (PIP_FIND_LINKS)
if [[ ! -f $WHEELS/complete ]]; then
  "$VENV/bin/pip" download -q --no-deps -d "$WHEELS" "sglang==$SGLANG"
fi
"$VENV/bin/pip" install -q --no-deps --no-index --find-links "$WHEELS" "sglang==$SGLANG"
CONSTRAINTS=$VENV/constraints.txt
REQUIREMENTS=$VENV/requirements-cpu.txt
echo "torch==2.13.0" >"$CONSTRAINTS"
# Requirements without an `extra` marker, minus what exists only for CUDA (or only for multimodal
# models: torchvision's PyPI build does not even load beside the CPU torch).
"$VENV/bin/python" - "$REQUIREMENTS" <<'PY'
import re
import sys
from importlib.metadata import requires

CUDA_ONLY = re.compile(
    r"^(torch|cuda-python|flashinfer.*|flash-attn.*|flash_attn.*|nvidia-.*|nvshmem.*|sgl-.*|sglang-kernel"
    r"|tilelang|quack-kernels|humming-kernels|torchaudio|torch[-_]memory[-_]saver|torchcodec"
    r"|torchvision|timm|av|decord2?)$"
)
kept = []
for line in requires("sglang") or []:
    spec, _, marker = line.partition(";")
    if "extra" in marker:
        continue
    name = re.split(r"[\s\[<>=!~;(]", spec.strip(), maxsplit=1)[0]
    if CUDA_ONLY.match(name.lower().replace("_", "-")) or CUDA_ONLY.match(name.lower()):
        continue
    kept.append(line)
with open(sys.argv[1], "w", encoding="utf-8") as out:
    out.write("\n".join(kept) + "\n")
print(f"{len(kept)} non-CUDA requirements of sglang")
PY
if [[ ! -f $WHEELS/complete ]]; then
  # Every wheel the install needs (sdists built once), minus the torch already installed.
  "$VENV/bin/pip" wheel -q -w "$WHEELS" --find-links "$WHEELS" -r "$REQUIREMENTS" -c "$CONSTRAINTS"
  rm -f "$WHEELS"/torch-*.whl
  touch "$WHEELS/complete"
fi
"$VENV/bin/pip" install -q --no-index --find-links "$WHEELS" -r "$REQUIREMENTS" -c "$CONSTRAINTS"
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
touch "$VENV/.installed"
if [[ -n $LINK ]]; then ln -sfn "$VENV" ".venvs/$LINK"; fi
echo "$VENV is ready"
