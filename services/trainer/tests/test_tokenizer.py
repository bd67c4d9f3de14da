"""ExportTokenizer (issue 23): the trainer streams the tokenizer of its model folder, so a
controller builds jobs with no hub and no model. Reference: AutoTokenizer loaded from the
model folder itself."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lorafleet.errors import FailedPrecondition
from lorafleet.v1 import trainer_pb2
from lorafleet_trainer.servicer import TrainerServicer


async def exported(servicer: TrainerServicer) -> dict[str, bytes]:
    files: dict[str, bytearray] = {}
    digests = {}
    async for part in servicer.ExportTokenizer(trainer_pb2.ExportTokenizerRequest(), None):
        files.setdefault(part.chunk.path, bytearray()).extend(part.chunk.data)
        if part.chunk.sha256:
            digests[part.chunk.path] = part.chunk.sha256
    assert digests == {p: hashlib.sha256(d).hexdigest() for p, d in files.items()}
    return {p: bytes(d) for p, d in files.items()}


async def test_exported_files_rebuild_the_model_folders_tokenizer(
    make_engine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    servicer = TrainerServicer(make_engine(), "t", model_path=tiny_model_dir)
    try:
        files = await exported(servicer)
    finally:
        servicer.executor.shutdown()
    assert not any(name.endswith((".safetensors", ".bin")) for name in files)  # no weights
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    got = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    want = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Truncated BPTT: keys/values carried, 5 000 tokens. <|im_end|> ünïcode"
    assert got.encode(text) == want.encode(text)
    chat = [{"role": "user", "content": "What is my name?"}, {"role": "assistant", "content": "D"}]
    assert got.chat_template and got.apply_chat_template(
        chat, tokenize=False
    ) == want.apply_chat_template(chat, tokenize=False)
    assert got.all_special_tokens == want.all_special_tokens


async def test_a_folder_without_a_tokenizer_is_named(make_engine, model_dir: Path) -> None:
    servicer = TrainerServicer(make_engine(), "t", model_path=model_dir)  # weights only
    try:
        with pytest.raises(FailedPrecondition) as err:
            await exported(servicer)
    finally:
        servicer.executor.shutdown()
    assert err.value.reason == "NO_TOKENIZER" and err.value.field == "base_model"
