"""Model specs on the command line (`tiny`, `bench`, `smollm2`, or a folder) → local folders.

Shared by `lorafleet up` and `lorafleet demo`, so neither imports the other.
"""

from __future__ import annotations

from pathlib import Path

from lorafleet_cli.fleet import FleetError


def resolve_model(spec: str) -> Path:
    """tiny | bench | smollm2 | a model folder → a validated local folder."""
    from lorafleet.errors import LorafleetError
    from lorafleet_models.cli import default_cache_root
    from lorafleet_models.tiny import ensure_model
    from lorafleet_models.validate import validate_model_dir

    cache = default_cache_root()
    try:
        if spec in ("tiny", "bench"):
            return ensure_model(spec, cache)
        if spec == "smollm2":
            from lorafleet_models.smollm2 import import_smollm2

            return import_smollm2(cache / "smollm2-135m-instruct")
        path = Path(spec).expanduser().resolve()
        validate_model_dir(path)
        return path
    except LorafleetError as exc:
        raise FleetError(str(exc)) from None


def check_engine_serves(model: Path, engine: str) -> None:
    """Refuse, before any process starts, a model the rollout engine would refuse at its own
    start: the torch engine's families (`lorafleet.families`, the rule the rollout applies).
    SGLang and vLLM servers check what they serve themselves."""
    if engine != "torch":
        return
    from lorafleet.errors import InvalidArgument
    from lorafleet.families import check_torch_servable

    try:
        check_torch_servable(model)
    except InvalidArgument as exc:
        raise FleetError(f"--model {exc.message}") from None
