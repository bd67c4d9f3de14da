"""Build a model folder from a preset and a seed: tokenizer, seeded init, short pre-training.

The folder is a normal transformers folder (config.json, generation_config.json,
model.safetensors, tokenizer files) plus `lorafleet_build.json`, the record of what produced it.
Two builds with the same arguments on the same software give byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen3MoeConfig,
)

from lorafleet.errors import InvalidArgument
from lorafleet_models.corpus import CORPUS_PATH, corpus_sha256, read_corpus
from lorafleet_models.presets import Preset, get_preset
from lorafleet_models.pretrain import pretrain, single_thread, token_stream
from lorafleet_models.tokenizer import IM_END, save_tokenizer, train_tokenizer

BUILD_RECORD = "lorafleet_build.json"
_PACKAGE_DIR = Path(__file__).resolve().parent
# Every module whose code decides the bytes of a built folder; their hash is part of the cache key.
_BUILD_SOURCES = ("build.py", "corpus.py", "presets.py", "pretrain.py", "tokenizer.py")


@dataclass(frozen=True)
class BuildRecord:
    preset: str
    seed: int
    steps: int
    final_pretrain_loss: float | None
    corpus_sha256: str
    code_sha256: str
    torch_version: str
    transformers_version: str
    num_parameters: int
    tokenizer_size: int


def build_code_sha256() -> str:
    digest = hashlib.sha256()
    for name in _BUILD_SOURCES:
        digest.update(name.encode())
        digest.update((_PACKAGE_DIR / name).read_bytes())
    return digest.hexdigest()


def build_model(
    preset: str, out_dir: Path, seed: int = 0, *, steps: int | None = None
) -> BuildRecord:
    """Write the model folder for `preset` into `out_dir` (created; must be empty if it exists).

    `steps` overrides the preset's pre-training length (tests use a short run of the same code).
    """
    spec = get_preset(preset)
    steps = spec.pretrain_steps if steps is None else steps
    if steps < 0:
        raise InvalidArgument(f"must be >= 0, got {steps}", field="steps")
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise InvalidArgument(f"{str(out_dir)!r} exists and is not an empty folder", field="dir")
    out_dir.mkdir(parents=True, exist_ok=True)

    corpus_text = read_corpus()
    tokenizer = train_tokenizer(corpus_text, spec.vocab_size)
    if len(tokenizer) > spec.vocab_size:
        raise AssertionError(f"tokenizer has {len(tokenizer)} tokens > vocab {spec.vocab_size}")
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = model_config(spec, tokenizer.eos_token_id, tokenizer.pad_token_id)

    with torch.random.fork_rng(devices=[]), single_thread():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        loss = pretrain(
            model,
            token_stream(corpus_text, tokenizer),
            steps=steps,
            batch_size=spec.batch_size,
            seq_len=spec.seq_len,
            learning_rate=spec.learning_rate,
            seed=seed,
        )
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[im_end_id, tokenizer.eos_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir, spec.max_position_embeddings)
    record = BuildRecord(
        preset=spec.name,
        seed=seed,
        steps=steps,
        final_pretrain_loss=None if steps == 0 else round(loss, 6),
        corpus_sha256=corpus_sha256(CORPUS_PATH),
        code_sha256=build_code_sha256(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        num_parameters=sum(p.numel() for p in model.parameters()),
        tokenizer_size=len(tokenizer),
    )
    (out_dir / BUILD_RECORD).write_text(json.dumps(asdict(record), indent=2) + "\n")
    return record


class _CommonConfig(TypedDict):
    """The config arguments every architecture takes."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def model_config(spec: Preset, eos_id: int, pad_id: int) -> PretrainedConfig:
    """The transformers config of a preset (its `arch`), with tied embeddings."""
    common = _CommonConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    if spec.arch == "qwen3_moe":
        moe = Qwen3MoeConfig(
            **common,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
        )
        # Not in Qwen3MoeConfig's signature, but kept as an attribute and written to
        # config.json, where serving engines read it.
        moe.head_dim = spec.hidden_size // spec.num_heads
        return moe
    if spec.arch == "phi3":
        return Phi3Config(**common, original_max_position_embeddings=spec.max_position_embeddings)
    return LlamaConfig(**common)
