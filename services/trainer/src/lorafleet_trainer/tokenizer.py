"""The base model's tokenizer as files, served to the controller (issue 23).

Managed jobs tokenise their data and render the chat template in the controller. Loading
the tokenizer there by the served name needs that name to resolve (a hub, or the folder
installed into the local cache on the same machine), which a controller on Kubernetes has
not got. The trainer holds the model folder, so it serves the tokenizer: loaded with
`AutoTokenizer` from the folder and written back with `save_pretrained`, which gives exactly
the files `AutoTokenizer` needs to rebuild the same tokenizer (chat template included),
whatever layout the folder has.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from lorafleet.errors import FailedPrecondition


def tokenizer_files(model_path: Path) -> dict[str, bytes]:
    """{file name: bytes} of the tokenizer in `model_path`; FailedPrecondition without one."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(model_path))
    except (OSError, ValueError) as exc:
        raise FailedPrecondition(
            f"the model folder has no tokenizer: {exc}", field="base_model", reason="NO_TOKENIZER"
        ) from exc
    with tempfile.TemporaryDirectory(prefix="lorafleet-tokenizer-") as tmp:
        tok.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}
