"""The `models` CLI: build, list, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet_models.cli import main


def test_build_then_list(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["models", "build", "tiny", str(tmp_path / "m"), "--seed", "2", "--steps", "2"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["preset"] == "tiny" and summary["seed"] == 2 and summary["steps"] == 2
    (tmp_path / "junk").mkdir()
    assert main(["models", "list", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("junk\tinvalid: ")
    assert lines[1].startswith("m\tLlamaForCausalLM\tvocab=2048\thidden=128\tlayers=2\tctx=512")


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "x").write_text("occupied")
    assert main(["models", "build", "tiny", str(tmp_path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: dir: ") and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:
        main(["models", "build", "huge", str(tmp_path / "y")])
    assert e.value.code == 2


def test_runs_as_a_module() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "lorafleet_models.cli", "models", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "build" in proc.stdout and "import" in proc.stdout and "list" in proc.stdout
