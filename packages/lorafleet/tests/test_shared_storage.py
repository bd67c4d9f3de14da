"""The shared adapter root's rules: start-up check, write-once folders, references confined."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lorafleet import shared_storage
from lorafleet.errors import FailedPrecondition, InvalidArgument
from lorafleet.settings import SettingsError


def _staged(root: Path, content: bytes) -> Path:
    staged = root / f".tmp-{hashlib.sha256(content).hexdigest()[:8]}"
    staged.mkdir(parents=True)
    (staged / "adapter_config.json").write_bytes(b"{}")
    (staged / "adapter_model.safetensors").write_bytes(content)
    return staged


def test_check_root_wants_an_absolute_writable_folder(tmp_path: Path) -> None:
    var = "LORAFLEET_X_SHARED_ADAPTER_ROOT"
    assert shared_storage.check_root(tmp_path / "new", var) == (tmp_path / "new").resolve()
    with pytest.raises(SettingsError, match=f"{var}=relative: must be an absolute path"):
        shared_storage.check_root(Path("relative"), var)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(SettingsError, match=f"{var}=.*not a writable folder"):
        shared_storage.check_root(tmp_path / "file", var)


def test_a_version_is_written_once_and_described_by_digest(tmp_path: Path) -> None:
    root = tmp_path.resolve()
    final = shared_storage.adapter_folder(root, "run-1", 3)
    final.parent.mkdir(parents=True)
    first = shared_storage.publish_folder(_staged(final.parent, b"weights-1"), final)
    assert first["adapter_model.safetensors"] == shared_storage.FileRef(
        (final / "adapter_model.safetensors").as_uri(),
        hashlib.sha256(b"weights-1").hexdigest(),
        len(b"weights-1"),
    )
    # a repeated publish of the same version answers what is there, never a mix
    again = shared_storage.publish_folder(_staged(final.parent, b"weights-2"), final)
    assert again == first
    assert shared_storage.common_folder(root, first, "files") == final


def test_references_must_lie_in_the_root_and_one_folder(tmp_path: Path) -> None:
    root = (tmp_path / "root").resolve()
    inside = root / "adapters" / "r" / "1" / "a"
    with pytest.raises(FailedPrecondition, match="not inside"):
        shared_storage.resolve(root, (tmp_path / "elsewhere").as_uri(), "uri")
    with pytest.raises(FailedPrecondition, match="not inside"):
        shared_storage.resolve(root, (root / ".." / "elsewhere").as_uri(), "uri")
    with pytest.raises(InvalidArgument, match="file://"):
        shared_storage.resolve(root, "s3://bucket/a", "uri")
    assert shared_storage.resolve(root, inside.as_uri(), "uri") == inside
    two = {
        "a": shared_storage.FileRef(inside.as_uri(), "x", 1),
        "b": shared_storage.FileRef((root / "adapters" / "r" / "2" / "b").as_uri(), "y", 1),
    }
    with pytest.raises(InvalidArgument, match="one folder"):
        shared_storage.common_folder(root, two, "files")
    with pytest.raises(InvalidArgument, match="registration_id"):
        shared_storage.adapter_folder(root, "..", 1)
