"""`ensure_model`: the cached, seeded model folders tests and demos load.

A folder is named by its cache key (preset, seed, build-code hash, corpus hash, torch and
transformers versions), so a change to any of them builds a new folder instead of reusing a
stale one; `cache.build_once` makes the build atomic and safe when processes race.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import transformers

from lorafleet.hub import record_hub_id
from lorafleet_models.build import BUILD_RECORD, build_code_sha256, build_model
from lorafleet_models.cache import build_once
from lorafleet_models.corpus import corpus_sha256
from lorafleet_models.presets import get_preset

__all__ = ["build_model", "cache_key", "ensure_model"]

# Hub organisation of locally built models' served names (`lorafleet/<folder name>`).
HUB_ORG = "lorafleet"


def cache_key(preset: str, seed: int = 0, steps: int | None = None) -> str:
    get_preset(preset)
    parts = (
        preset,
        str(seed),
        build_code_sha256(),
        corpus_sha256(),
        torch.__version__,
        transformers.__version__,
        *(() if steps is None else (f"steps={steps}",)),
    )
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"{preset}-seed{seed}-{digest}"


def ensure_model(preset: str, cache_root: Path, seed: int = 0, *, steps: int | None = None) -> Path:
    """Return the folder of `preset` built from `seed` under `cache_root`, building it if missing.

    `steps` overrides the pre-training length (and is part of the key); tests use it to exercise
    the cache with cheap builds.
    """
    final = Path(cache_root) / cache_key(preset, seed, steps)

    def build(tmp: Path) -> None:
        build_model(preset, tmp, seed, steps=steps)
        # The served name clients load the tokenizer by (lorafleet.hub); the folder only
        # appears under its final name after this returns, so it is never seen without it.
        record_hub_id(tmp, f"{HUB_ORG}/{final.name}")

    return build_once(final, build, BUILD_RECORD)
