"""`python -m lorafleet_rollout`: settings first (bad ones: one line, exit 2), torch after."""

from __future__ import annotations

import dataclasses
import sys

from lorafleet import hub, quantize
from lorafleet.errors import InvalidArgument
from lorafleet.families import check_torch_servable
from lorafleet.replica import ReplicaSettings
from lorafleet.settings import ServerSettings, SettingsError, load_or_exit
from lorafleet.shared_storage import check_root
from lorafleet_rollout.allocator import exec_with_tunables
from lorafleet_rollout.settings import PREFIX, RolloutSettings


def main() -> None:
    settings = load_or_exit(RolloutSettings, PREFIX)
    server = load_or_exit(ServerSettings, PREFIX)
    replica = load_or_exit(ReplicaSettings, PREFIX)
    if settings.shared_adapter_root is not None:
        try:
            root = check_root(settings.shared_adapter_root, f"{PREFIX}SHARED_ADAPTER_ROOT")
        except SettingsError as exc:
            _exit(str(exc))
        settings = dataclasses.replace(settings, shared_adapter_root=root)
    if settings.engine != "torch" and not settings.engine_url:
        _exit(f"{PREFIX}ENGINE_URL is required when {PREFIX}ENGINE={settings.engine}")
    served_by_engine = (quantize.NONE, *quantize.ENGINE_FLAGS)
    if settings.engine != "torch" and settings.quantization not in served_by_engine:
        _exit(
            f"{PREFIX}QUANTIZATION={settings.quantization}: SGLang and vLLM serve "
            f"{', '.join(quantize.ENGINE_FLAGS)} (start the server with --quantization); "
            "the torch engine serves every setting"
        )
    if settings.engine == "torch" and not (settings.model_path / "config.json").is_file():
        _exit(f"{PREFIX}MODEL_PATH={settings.model_path}: no config.json there")
    if settings.engine == "torch":
        try:
            check_torch_servable(settings.model_path)  # the rule `lorafleet up` checks too
        except InvalidArgument as exc:
            _exit(f"{PREFIX}MODEL_PATH={exc.message}")
    try:
        served = settings.served_base_model
    except ValueError as exc:
        _exit(f"{PREFIX}{exc}")
    if (settings.model_path / "config.json").is_file():
        # Clients load the tokenizer by the served name: make it resolve offline here.
        hub.install(settings.model_path, served)

    if settings.engine == "torch":
        # The engine's heap settings apply from process start: this re-executes once.
        exec_with_tunables()
    from lorafleet_rollout.app import run  # imports torch

    run(settings, server, replica)


def _exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    main()
