"""Where the trainer writes: names cannot leave the run's folder (the second wall behind the
name rule), and a full disk is a classified error naming the folder and the space left."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from lorafleet.errors import InvalidArgument, ResourceExhausted
from lorafleet_trainer import checkpoint
from lorafleet_trainer.domain import LoraSpec

from .test_state import SPEC, folder_of, train


def tree(root: Path) -> set[Path]:
    return set(root.rglob("*")) if root.exists() else set()


def test_names_cannot_leave_the_run_folder(make_engine, tmp_path: Path) -> None:
    engine = make_engine()
    engine.storage_root = tmp_path / "states"
    engine.bind(0, "reg", SPEC)
    train(engine, 0, "reg", 0)
    engine.save_state("s0", 0, "reg", "kept", True)
    outside = tmp_path / "outside"
    outside.mkdir()
    # a folder planted in the run's folder that points outside the root: a valid name that
    # resolves elsewhere is refused by the wall, not followed
    (engine.storage_root / "reg" / "escape").symlink_to(outside, target_is_directory=True)
    before = tree(tmp_path)
    for i, name in enumerate(["..", ".", "a/b", "../../outside", "x" * 10_000, "a\x00b", "escape"]):
        with pytest.raises(InvalidArgument) as exc:
            engine.save_state(f"bad{i}", 0, "reg", name, True)
        assert exc.value.field == "name"
    with pytest.raises(InvalidArgument) as exc:
        checkpoint.state_dir(engine.storage_root, "..", "ok")
    assert exc.value.field == "registration_id"
    assert tree(tmp_path) == before and not any(outside.iterdir())


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 64 KiB tmpfs (needs root, as CI's containers run): writes there really fail
    with ENOSPC. Unmounted afterwards."""
    mount = tmp_path / "tiny-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_is_resource_exhausted_and_changes_nothing(
    make_engine, tiny_disk: Path, tmp_path: Path
) -> None:
    engine = make_engine()
    engine.storage_root = tiny_disk
    engine.bind(0, "reg", LoraSpec(rank=16, seed=3))
    train(engine, 0, "reg", 0)
    with pytest.raises(ResourceExhausted) as exc:
        engine.save_state("full", 0, "reg", "big", True)
    assert (exc.value.reason, exc.value.field) == ("DISK_FULL", "storage_root")
    assert str(tiny_disk / "reg" / "big") in exc.value.message
    free = shutil.disk_usage(tiny_disk).free
    assert f"{free} bytes free" in exc.value.message, exc.value.message
    assert [p.name for p in (tiny_disk / "reg").iterdir()] == []  # no half-written folder
    # the run is intact: it trains on and saves where there is room, as if nothing happened
    train(engine, 0, "reg", 1)
    engine.storage_root = tmp_path / "roomy"
    ref = engine.save_state("roomy", 0, "reg", "big", True)
    assert (folder_of(ref) / "adapter_model.safetensors").stat().st_size > 64 * 1024
