"""`lorafleet models ...`: build, import and list local model folders.

    python -m lorafleet_models.cli models build PRESET DIR [--seed N] [--steps N]
      (PRESET: tiny, tiny-moe, tiny-phi3, bench)
    python -m lorafleet_models.cli models import smollm2 DIR
    python -m lorafleet_models.cli models list [CACHE]

Errors print one line to stderr and exit with status 2; nothing is half-written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from lorafleet.errors import LorafleetError
from lorafleet_models.presets import PRESETS
from lorafleet_models.validate import validate_model_dir

RECORD_FILES = ("lorafleet_build.json", "lorafleet_import.json")


def default_cache_root() -> Path:
    env = os.environ.get("LORAFLEET_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "lorafleet" / "models"


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="lorafleet")
    groups = top.add_subparsers(dest="group", required=True)
    models = groups.add_parser("models", help="local model folders").add_subparsers(
        dest="command", required=True
    )
    build = models.add_parser("build", help="build a seeded model folder from a preset")
    build.add_argument("preset", choices=sorted(PRESETS))
    build.add_argument("dir", type=Path)
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--steps", type=int, default=None, help="override pre-training steps")
    imp = models.add_parser("import", help="convert a packaged model into a normal folder")
    imp.add_argument("source", choices=["smollm2"])
    imp.add_argument("dir", type=Path)
    lst = models.add_parser("list", help="list model folders in a cache")
    lst.add_argument("cache", type=Path, nargs="?", default=None)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "build":
            return _build(args.preset, args.dir, args.seed, args.steps)
        if args.command == "import":
            return _import(args.dir)
        return _list(args.cache or default_cache_root())
    except LorafleetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _build(preset: str, out_dir: Path, seed: int, steps: int | None) -> int:
    from lorafleet_models.build import build_model

    started = time.monotonic()
    record = build_model(preset, out_dir, seed, steps=steps)
    summary = {**asdict(record), "dir": str(out_dir), "seconds": time.monotonic() - started}
    print(json.dumps(summary, indent=2))
    return 0


def _import(out_dir: Path) -> int:
    from lorafleet_models.smollm2 import import_smollm2

    print(import_smollm2(out_dir))
    return 0


def _list(cache: Path) -> int:
    if not cache.is_dir():
        print(f"no model cache at {cache}", file=sys.stderr)
        return 0
    for folder in sorted(p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")):
        try:
            info = validate_model_dir(folder)
        except LorafleetError as e:
            print(f"{folder.name}\tinvalid: {e}")
            continue
        record = next((folder / f for f in RECORD_FILES if (folder / f).is_file()), None)
        extra = json.loads(record.read_text()) if record else {}
        loss = extra.get("final_pretrain_loss")
        print(
            f"{folder.name}\t{info.architecture}\tvocab={info.vocab_size}\t"
            f"hidden={info.hidden_size}\tlayers={info.num_layers}\tctx={info.max_context}"
            + (f"\tpretrain_loss={loss}" if loss is not None else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
