"""Served names resolve offline: a model folder installed into a hub cache loads by its id
with transformers, in a separate process that sees only the cache (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lorafleet import hub

LOAD = """
import json, sys
from transformers import AutoConfig, AutoTokenizer
name = sys.argv[1]
tok = AutoTokenizer.from_pretrained(name)
cfg = AutoConfig.from_pretrained(name)
print(json.dumps({"ids": tok.encode("What is my name?"), "vocab": cfg.vocab_size,
                  "template": tok.chat_template is not None}))
"""


def _load(name: str, cache: Path, cwd: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", LOAD, name],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_installed_model_loads_offline_by_its_id(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    name = hub.served_name(tiny_model_dir)
    assert "/" in name
    cache = tmp_path / "hub"
    snapshot = hub.install(tiny_model_dir, name, cache)
    again = hub.install(tiny_model_dir, name, cache)  # idempotent: same revision, same files
    assert again == snapshot
    got = _load(name, cache, tmp_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert got["ids"] == tok.encode("What is my name?")
    assert got["vocab"] == AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    assert got["template"]


def test_names_without_an_org_are_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="org/name"):
        hub.served_name(tiny_model_dir, override="just-a-name")
    assert hub.served_name(tiny_model_dir, override="Org/Model-1") == "Org/Model-1"


def test_a_folder_without_a_record_is_served_as_local(tmp_path: Path) -> None:
    folder = tmp_path / "My Model"
    folder.mkdir()
    assert hub.served_name(folder) == "local/My-Model"
    hub.record_hub_id(folder, "acme/model")
    assert hub.served_name(folder) == "acme/model"
    assert json.loads((folder / hub.RECORD).read_text()) == {"hub_id": "acme/model"}
