"""Model presets: the shape of each locally built model and how long it is pre-trained.

"tiny" (~0.7 M parameters) is what unit tests load; it is pre-trained on the shipped corpus so
LoRA has something to adapt. "bench" (~20 M, the 512/6/1536 shape of platform.md §2.2) exists
for speed figures, so it gets only a short pre-training. "tiny-moe" is the tiny model as a
Qwen3-MoE (8 experts, 2 per token, fused expert banks), "tiny-phi3" as a Phi-3 (fused
`qkv_proj` and `gate_up_proj`): the architectures whose LoRA targets are not plain per-role
Linears.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet.errors import InvalidArgument


@dataclass(frozen=True)
class Preset:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    pretrain_steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    arch: str = "llama"  # llama | qwen3_moe | phi3
    num_experts: int = 0  # qwen3_moe only
    experts_per_token: int = 0
    moe_intermediate_size: int = 0


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        name="tiny",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        intermediate_size=384,
        vocab_size=2048,
        max_position_embeddings=512,
        pretrain_steps=400,
        batch_size=16,
        seq_len=64,
        learning_rate=6e-3,
    ),
    "bench": Preset(
        name="bench",
        hidden_size=512,
        num_layers=6,
        num_heads=8,
        num_kv_heads=8,
        intermediate_size=1536,
        vocab_size=2048,
        max_position_embeddings=2048,
        pretrain_steps=20,
        batch_size=8,
        seq_len=128,
        learning_rate=1e-3,
    ),
    "tiny-moe": Preset(
        name="tiny-moe",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        vocab_size=2048,
        max_position_embeddings=512,
        pretrain_steps=300,
        batch_size=16,
        seq_len=64,
        learning_rate=6e-3,
        arch="qwen3_moe",
        num_experts=8,
        experts_per_token=2,
        moe_intermediate_size=96,
    ),
    "tiny-phi3": Preset(
        name="tiny-phi3",
        hidden_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=384,
        vocab_size=2048,
        max_position_embeddings=512,
        pretrain_steps=200,
        batch_size=16,
        seq_len=64,
        learning_rate=6e-3,
        arch="phi3",
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}", field="preset"
        ) from None
