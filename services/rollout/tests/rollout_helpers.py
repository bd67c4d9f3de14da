"""Helpers shared by the rollout tests: build a small model, make PEFT adapters, reference runs."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

REPO = Path(__file__).resolve().parents[3]
CORPUS = REPO / "packages/lorafleet-models/src/lorafleet_models/data/corpus.txt"


def build_model(
    out: Path, *, hidden: int = 64, layers: int = 2, seed: int = 0, arch: str = "llama"
) -> Path:
    """A random Llama (or Qwen3: q/k RMSNorm) with grouped-query attention and a 320-token
    byte-level BPE tokenizer, saved as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = CORPUS.read_text()[:20000] if CORPUS.exists() else "hello world. " * 200
    tok.train_from_iterator([text], trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|pad|>"
    )
    wrapped.save_pretrained(out)
    torch.manual_seed(seed)
    config = (Qwen3Config if arch == "qwen3" else LlamaConfig)(
        vocab_size=len(wrapped),
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=wrapped.eos_token_id,
        pad_token_id=wrapped.pad_token_id,
        tie_word_embeddings=True,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def load_base(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(
    model_dir: Path,
    out: Path,
    *,
    seed: int,
    rank: int = 4,
    targets: tuple[str, ...] = ("q_proj", "v_proj", "down_proj"),
    scale: float = 1.0,
) -> Path:
    """A PEFT folder with seeded random, non-zero A and B, so it visibly changes outputs."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=list(targets), init_lora_weights=False
    )
    model = get_peft_model(load_base(model_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(scale)
    model.save_pretrained(out, save_embedding_layers=False)  # LoRA weights only, as we export
    return out


def reference_model(model_dir: Path, adapter: Path | None) -> torch.nn.Module:
    """transformers (+ PEFT) loaded the ordinary way: the reference the engine must match."""
    base = load_base(model_dir)
    if adapter is None:
        return base
    return PeftModel.from_pretrained(base, adapter).eval()


def reference_generate(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers `generate`, greedy, stopping at the model's EOS ids (kept, as in Tinker)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """Greedy by full forward passes without a cache and without EOS handling."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def reference_logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t] | tokens[:t]) for t >= 1 from one plain forward pass."""
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return logp.gather(-1, ids[0, 1:, None]).flatten()


def file_digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def adapter_chunks(
    registration_id: str, version: int, folder: Path, *, rank: int = 4, chunk: int = 4096
) -> list:
    """A LoadAdapter stream: the header with every file's SHA-256, then the files in chunks."""
    from lorafleet.v1 import common_pb2, rollout_pb2

    digests = file_digests(folder)
    messages = [
        rollout_pb2.LoadAdapterChunk(
            header=rollout_pb2.AdapterHeader(
                adapter=common_pb2.AdapterRef(registration_id=registration_id, version=version),
                lora_config=common_pb2.LoraConfig(rank=rank, alpha=2 * rank),
                file_sha256=digests,
            )
        )
    ]
    for name in digests:
        data = (folder / name).read_bytes()
        for offset in range(0, len(data), chunk):
            last = offset + chunk >= len(data)
            messages.append(
                rollout_pb2.LoadAdapterChunk(
                    chunk=common_pb2.FileChunk(
                        path=name,
                        offset=offset,
                        data=data[offset : offset + chunk],
                        sha256=digests[name] if last else "",
                    )
                )
            )
    return messages
