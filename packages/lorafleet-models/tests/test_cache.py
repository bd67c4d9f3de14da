"""ensure_model: keyed folders, built once, atomically, safely under concurrent callers."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from lorafleet_models.build import BUILD_RECORD
from lorafleet_models.tiny import cache_key, ensure_model

ENSURE = """
import sys
from pathlib import Path
from lorafleet_models.tiny import ensure_model
print(ensure_model("tiny", Path(sys.argv[1]), seed=5, steps=3))
"""


def test_key_covers_preset_seed_and_steps() -> None:
    keys = {
        cache_key("tiny"),
        cache_key("tiny", seed=1),
        cache_key("bench"),
        cache_key("tiny", steps=3),
    }
    assert len(keys) == 4
    assert cache_key("tiny") == cache_key("tiny")
    assert cache_key("tiny").startswith("tiny-seed0-")


def test_builds_once_then_reuses(tmp_path: Path) -> None:
    first = ensure_model("tiny", tmp_path, seed=5, steps=3)
    assert first == tmp_path / cache_key("tiny", 5, 3)
    record = first / BUILD_RECORD
    built_at = record.stat().st_mtime_ns
    again = ensure_model("tiny", tmp_path, seed=5, steps=3)
    assert again == first and record.stat().st_mtime_ns == built_at
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [first.name]


def test_incomplete_folder_is_rebuilt(tmp_path: Path) -> None:
    debris = tmp_path / cache_key("tiny", 5, 3)
    debris.mkdir()
    (debris / "model.safetensors").write_bytes(b"truncated")
    folder = ensure_model("tiny", tmp_path, seed=5, steps=3)
    assert (folder / BUILD_RECORD).is_file()
    assert (folder / "model.safetensors").stat().st_size > 1000


def test_concurrent_processes_share_one_build(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ENSURE, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(3)
    ]
    deadline = time.monotonic() + 120
    outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert len({out.strip() for out in outputs}) == 1
    entries = sorted(p.name for p in tmp_path.iterdir())
    # One published folder plus its lock file; no temporary build folders left behind.
    assert entries == [f".{cache_key('tiny', 5, 3)}.lock", cache_key("tiny", 5, 3)]
