#!/usr/bin/env bash
# Create .venvs/llama-cpp for `bench/sampling.py --vs-llama-cpp`: llama-cpp-python built from its
# PyPI sdist for this machine's CPU (CPU only, no BLAS: ggml's own kernels, as llama.cpp serves by
# default; the compile is most of the time, minutes on 2 cores), plus llama.cpp's own converters
# from the same sdist, so the GGUFs are written by the code that reads them. The converters run
# with the project's python (torch, transformers, safetensors are there: the venv stays small);
# the one module they need that it lacks, sentencepiece (imported before the converter finds out
# the model has no tokenizer.model), goes to convert-extras/, put on their PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
# .venvs/llama-cpp links the machine's cached venv of this recipe (tests/cached_venv.sh).
# shellcheck source=../tests/cached_venv.sh
source tests/cached_venv.sh
if cached_venv llama-cpp bench/setup_llama_cpp_venv.sh; then exit 0; fi
version=0.3.36
python3.11 -m venv "$VENV"
sdist=$(mktemp -d)
trap 'rm -rf "$sdist"' EXIT
"$VENV/bin/pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$sdist"
CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
  "$VENV/bin/pip" install -q "$sdist/llama_cpp_python-$version.tar.gz"
tar -xzf "$sdist/llama_cpp_python-$version.tar.gz" -C "$sdist"
vendor=$sdist/llama_cpp_python-$version/vendor/llama.cpp
mkdir -p "$VENV/llama.cpp"
cp -r "$vendor/convert_hf_to_gguf.py" "$vendor/convert_lora_to_gguf.py" "$vendor/conversion" \
  "$vendor/gguf-py" "$VENV/llama.cpp/"
"$VENV/bin/pip" install -q --no-deps --target "$VENV/convert-extras" sentencepiece==0.2.3
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
touch "$VENV/.installed"
ln -sfn "$VENV" .venvs/llama-cpp
echo "$VENV is ready"
