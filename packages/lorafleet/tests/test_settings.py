from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from lorafleet.settings import ServerSettings, SettingsError, load_settings, setting


@dataclass(frozen=True)
class Example:
    model_path: Path = setting(doc="Model folder.")
    slots: int = setting(4, doc="Slots.", min=1, max=256)
    engine: str = setting("torch", doc="Engine.", choices=("torch", "sglang"))
    peers: tuple[str, ...] = setting((), doc="Peers.")
    verbose: bool = setting(False, doc="Verbose.")


def test_loads_and_converts() -> None:
    env = {"X_MODEL_PATH": "/m", "X_SLOTS": "8", "X_PEERS": "a:1, b:2", "X_VERBOSE": "yes"}
    s = load_settings(Example, "X_", env)
    assert s == Example(Path("/m"), 8, "torch", ("a:1", "b:2"), True)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({}, "X_MODEL_PATH is required: Model folder."),
        ({"X_MODEL_PATH": "/m", "X_SLOTS": "0"}, "X_SLOTS=0: must be >= 1"),
        ({"X_MODEL_PATH": "/m", "X_SLOTS": "many"}, "X_SLOTS='many': expected an integer"),
        ({"X_MODEL_PATH": "/m", "X_ENGINE": "tpu"}, "X_ENGINE='tpu': must be one of torch, sglang"),
        ({"X_MODEL_PATH": "/m", "X_VERBOSE": "maybe"}, "X_VERBOSE='maybe': expected true/false"),
    ],
)
def test_bad_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(Example, "X_", env)
    assert str(info.value) == message


def test_server_defaults_are_valid() -> None:
    assert load_settings(ServerSettings, "NOPE_", {}).port == 50051
