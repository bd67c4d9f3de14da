"""A folder is visible under its final name only once its files, its entries and the rename
are on disk (durable.py): the fsyncs and the rename, in order, as the kernel sees them.

The calls go through to the real os.fsync and os.rename on a real filesystem; the test only
records which file or directory each fsync named (from /proc/self/fd) and when the rename
happened. A power-cut test needs a filesystem that drops unsynced writes (issue 37)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lorafleet import durable
from lorafleet.shared_storage import publish_folder


@pytest.fixture
def trace(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    calls: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        real_rename(src, dst)
        calls.append(("rename", f"{src} -> {dst}"))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    return calls


def written(tmp: Path) -> Path:
    (tmp / "sub").mkdir(parents=True)
    (tmp / "a.safetensors").write_bytes(b"a" * 100)
    (tmp / "manifest.json").write_text("{}")
    (tmp / "sub" / "b.json").write_text("[]")
    return tmp


def check_order(calls: list[tuple[str, str]], tmp: Path, final: Path) -> None:
    """Every file, then its folder (a sub-folder before the folder holding it), then the
    rename, then the parent (the new name on disk)."""
    names = [path for kind, path in calls if kind == "fsync"]
    rename = next(i for i, (kind, _) in enumerate(calls) if kind == "rename")
    before, after = calls[:rename], calls[rename + 1 :]
    synced = {path for _, path in before}
    for path in final.rglob("*"):
        was = str(tmp / path.relative_to(final))
        assert was in synced, (was, calls)
        if path.is_dir():
            assert all(
                names.index(str(tmp / c.relative_to(final))) < names.index(was)
                for c in path.iterdir()
            )
    assert before[-1] == ("fsync", str(tmp)), calls
    assert after == [("fsync", str(final.parent))], calls


def test_commit_folder_syncs_files_folders_then_the_rename(tmp_path, trace) -> None:
    tmp, final = written(tmp_path / ".tmp-x"), tmp_path / "x"
    durable.commit_folder(tmp, final)
    check_order(trace, tmp, final)
    assert (final / "sub" / "b.json").read_text() == "[]" and not tmp.exists()


def test_a_published_adapter_version_is_committed_durably(tmp_path, trace) -> None:
    staged, final = written(tmp_path / "staged"), tmp_path / "adapters" / "run" / "1"
    files = publish_folder(staged, final)
    check_order(trace, staged, final)
    assert set(files) == {"a.safetensors", "manifest.json"}


def test_a_saved_state_is_committed_durably(tmp_path, trace) -> None:
    import torch

    from lorafleet_trainer import checkpoint

    final = tmp_path / "states" / "run" / "step-1"
    cfg = {"r": 1, "lora_alpha": 1, "target_modules": ["q_proj"], "peft_type": "LORA"}
    adapter = {"base_model.model.q_proj.lora_A.weight": torch.zeros(1, 2)}
    checkpoint.save_state(
        final, adapter_config=cfg, adapter=adapter, optimizer=None, trainer_state={}
    )
    renamed = next(path for kind, path in trace if kind == "rename")
    tmp = Path(renamed.split(" -> ")[0])
    check_order(trace, tmp, final)
