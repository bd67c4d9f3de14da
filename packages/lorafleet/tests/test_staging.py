"""lorafleet.staging: each wall of a chunked receive refuses with the field at fault, before a
byte of the refused chunk reaches the disk."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lorafleet.errors import InvalidArgument
from lorafleet.staging import ChunkedUpload


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    "path", ["", "../x", "a/../../x", "/etc/x", ".hidden", "a/.x", "a//b", "a/./b", "a\x00b"]
)
def test_a_path_that_is_not_plain_is_refused(tmp_path: Path, path: str) -> None:
    upload = ChunkedUpload(tmp_path / "root", max_bytes=1024)
    with pytest.raises(InvalidArgument) as exc:
        upload.write(path, 0, b"data", "")
    assert exc.value.field == "chunk.path"
    assert files_under(tmp_path) == {}


def test_the_cap_counts_every_file_and_refuses_before_writing(tmp_path: Path) -> None:
    upload = ChunkedUpload(tmp_path, max_bytes=10)
    upload.write("a", 0, b"123456", "")
    with pytest.raises(InvalidArgument) as exc:
        upload.write("b/c", 0, b"12345", "")
    assert (exc.value.field, exc.value.reason) == ("chunk.data", "TOO_LARGE")
    assert files_under(upload.folder) == {"a": b"123456"}
    upload.write("b/c", 0, b"1234", "")  # exactly the cap is fine
    assert upload.total == 10


def test_order_names_digests_and_completion(tmp_path: Path) -> None:
    upload = ChunkedUpload(tmp_path, max_bytes=1024, names=("w.bin", "cfg.json"))
    with pytest.raises(InvalidArgument) as other:
        upload.write("other.bin", 0, b"x", "")
    assert other.value.field == "chunk.path"
    upload.write("w.bin", 0, b"abc", "")
    with pytest.raises(InvalidArgument) as gap:
        upload.write("w.bin", 5, b"def", "")
    assert gap.value.field == "chunk.offset"
    with pytest.raises(InvalidArgument) as wrong:
        upload.write("w.bin", 3, b"def", "0" * 64)
    assert wrong.value.field == "chunk.sha256"
    upload = ChunkedUpload(tmp_path, max_bytes=1024, names=("w.bin", "cfg.json"))
    upload.write("w.bin", 0, b"abc", "")
    upload.write("w.bin", 3, b"def", hashlib.sha256(b"abcdef").hexdigest().upper())
    with pytest.raises(InvalidArgument) as closed:
        upload.write("w.bin", 6, b"more", "")
    assert closed.value.field == "chunk.offset"
    with pytest.raises(InvalidArgument) as missing:
        upload.require_complete(("w.bin", "cfg.json"))
    assert missing.value.field == "chunk.sha256" and "cfg.json" in missing.value.message
    upload.write("cfg.json", 0, b"", hashlib.sha256(b"").hexdigest())
    upload.require_complete(("w.bin", "cfg.json"))
    assert upload.digests()["w.bin"] == hashlib.sha256(b"abcdef").hexdigest()
    upload.discard()
    assert not upload.folder.exists()
