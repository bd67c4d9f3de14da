"""Upload staging hashes each file once, as it arrives; the adapter check uses those hashes."""

from __future__ import annotations

from pathlib import Path

import pytest
from rollout_helpers import file_digests

from lorafleet.errors import InvalidArgument
from lorafleet.staging import ChunkedUpload
from lorafleet_rollout.adapters import folder_digests, verify_digests


def stage(root: Path, files: dict[str, bytes], chunk: int = 5) -> ChunkedUpload:
    upload = ChunkedUpload(root, max_bytes=1 << 20)
    for name, data in files.items():
        for offset in range(0, len(data), chunk):
            upload.write(name, offset, data[offset : offset + chunk], "")
    return upload


def test_streamed_digests_equal_the_files_on_disk(tmp_path: Path) -> None:
    files = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": bytes(range(256))}
    upload = stage(tmp_path, files)
    source = tmp_path / "source"
    source.mkdir()
    for name, data in files.items():
        (source / name).write_bytes(data)
    assert upload.digests() == file_digests(source) == folder_digests(upload.folder)
    verify_digests(file_digests(source), upload.digests())


def test_digest_mismatch_missing_and_extra_files_are_refused(tmp_path: Path) -> None:
    upload = stage(tmp_path, {"a.json": b"{}", "w.bin": b"weights"})
    good = upload.digests()
    with pytest.raises(InvalidArgument) as wrong:
        verify_digests({**good, "w.bin": "0" * 64}, upload.digests())
    assert wrong.value.field == "header.file_sha256[w.bin]"
    with pytest.raises(InvalidArgument) as missing:
        verify_digests({**good, "more.bin": "0" * 64}, upload.digests())
    assert missing.value.field == "header.file_sha256"
    with pytest.raises(InvalidArgument) as extra:
        verify_digests({"a.json": good["a.json"]}, upload.digests())
    assert extra.value.field == "chunk.path"
    with pytest.raises(InvalidArgument) as none:
        verify_digests({}, upload.digests())
    assert none.value.field == "header.file_sha256"
