"""The one name rule (lorafleet.names) and the path wall behind it."""

from __future__ import annotations

from pathlib import Path

import pytest

from lorafleet import names
from lorafleet.contract import TinkerPath
from lorafleet.errors import InvalidArgument

BAD = [
    "",
    ".",
    "..",
    ".hidden",
    "a/b",
    "a\\b",
    "/abs",
    "a\nb",
    "a\x00b",
    "a b",
    "x" * 129,
    "x" * 10_000,
    "caf\u00e9",
    "a\ud800",
]


@pytest.mark.parametrize("name", BAD)
def test_bad_names_are_refused_naming_the_field(name: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        names.check_name(name, "path")
    assert exc.value.field == "path"
    assert len(exc.value.message) < 300  # a 10 KB name is not echoed back


@pytest.mark.parametrize("name", ["a", "step-1", "v1.2_final", "x" * 128, "-x", "a..b"])
def test_good_names_pass(name: str) -> None:
    assert names.check_name(name) == name


@pytest.mark.parametrize("name", ["..", ".", "x" * 10_000])
def test_tinker_paths_check_their_parts(name: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        TinkerPath.parse(f"tinker://s:train:0/weights/{name}", "model_path")
    assert exc.value.field == "model_path"
    with pytest.raises(InvalidArgument):
        TinkerPath.parse(f"tinker://{name}/weights/ok", "model_path")
    assert TinkerPath.parse("tinker://s:train:0/weights/ok").name == "ok"


def test_resolve_under_refuses_every_way_out(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "run").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (root / "run" / "link").symlink_to(tmp_path / "outside")
    assert names.resolve_under(root, "run", "ok") == (root / "run" / "ok").resolve()
    for parts in [("..",), (".",), ("run", "..", ".."), ("run", "link"), ("/etc",), ("",)]:
        with pytest.raises(InvalidArgument) as exc:
            names.resolve_under(root, *parts, field="name")
        assert exc.value.field == "name"
