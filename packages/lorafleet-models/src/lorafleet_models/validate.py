"""Check at startup that a folder holds a loadable causal LM, and describe it.

Services call `validate_model_dir` before loading anything heavy, so a wrong path or the wrong
kind of model fails in one line naming the setting instead of a stack trace from transformers.
Only the config and the tokenizer file are read; weights are checked for presence, not loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from lorafleet.errors import InvalidArgument

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    name: str
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_context: int
    has_tokenizer: bool
    tokenizer_id: str | None


def validate_model_dir(path: str | Path, *, field: str = "model_path") -> ModelInfo:
    """Describe the causal LM in `path`, or raise InvalidArgument naming `field`."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise InvalidArgument(f"model folder {str(folder)!r} does not exist", field=field)
    if not (folder / "config.json").is_file():
        raise InvalidArgument(f"{str(folder)!r} has no config.json", field=field)
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidArgument(
            f"{str(folder)!r}: unreadable config.json: {reason}", field=field
        ) from None
    model_type = getattr(config, "model_type", "")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise InvalidArgument(
            f"{str(folder)!r} holds a {model_type or 'unknown'!r} model, not a causal LM",
            field=field,
        )
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise InvalidArgument(
            f"{str(folder)!r} has no weights (expected one of {', '.join(WEIGHT_FILES)})",
            field=field,
        )
    vocab_size = int(config.vocab_size)
    has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
    tokenizer_size = _tokenizer_size(folder, field)
    if tokenizer_size is not None and tokenizer_size > vocab_size:
        raise InvalidArgument(
            f"{str(folder)!r}: tokenizer has {tokenizer_size} tokens but the model's "
            f"vocabulary has only {vocab_size}",
            field=field,
        )
    architectures = getattr(config, "architectures", None) or [
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    ]
    return ModelInfo(
        path=folder.resolve(),
        name=folder.resolve().name,
        architecture=architectures[0],
        model_type=model_type,
        vocab_size=vocab_size,
        hidden_size=int(config.hidden_size),
        num_layers=int(config.num_hidden_layers),
        max_context=int(getattr(config, "max_position_embeddings", 0) or 0),
        has_tokenizer=has_tokenizer,
        tokenizer_id=str(folder.resolve()) if has_tokenizer else None,
    )


def _tokenizer_size(folder: Path, field: str) -> int | None:
    """Token count of tokenizer.json (added tokens included), or None when there is none."""
    file = folder / "tokenizer.json"
    if not file.is_file():
        return None
    try:
        return Tokenizer.from_file(str(file)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the tokenizers library raises a bare Exception on bad files
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InvalidArgument(
            f"{str(folder)!r}: unreadable tokenizer.json: {reason}", field=field
        ) from None
