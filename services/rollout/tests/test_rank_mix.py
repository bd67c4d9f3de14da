"""Adapters of different rank classes (`lora.rank_class`) in one batch, on the native kernels
and on torch ops, for Linear projections and per-expert banks: every row matches PEFT with its
adapter alone, and each stack holds every adapter at its own class's rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from rollout_helpers import load_base, reference_model
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

from lorafleet_rollout.decoder import Decoder, PrefillPart
from lorafleet_rollout.lora import ExpertStacks, adapter_weights, make_route
from lorafleet_rollout.peft_io import check_fits, expert_banks, linear_shapes, read_peft_dir

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
#: Per model: (rank, target_modules, target_parameters) of each adapter; a0 and a2 share rank
#: class 4 on the MoE.
ADAPTERS = {
    "llama": ((4, ALL, []), (64, ALL, []), (8, ["v_proj", "down_proj"], [])),
    "qwen2-moe": (
        (4, ["q_proj", "up_proj"], EXPERTS),
        (16, ["o_proj"], EXPERTS),
        (2, ["v_proj"], ["mlp.experts.down_proj"]),
    ),
}
CLASSES = {"llama": {4: 1, 8: 1, 64: 1}, "qwen2-moe": {4: 2, 16: 1}}


def qwen2_moe(folder: Path) -> Path:
    torch.manual_seed(0)
    config = Qwen2MoeConfig(
        vocab_size=320,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=2,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(ADAPTERS))
def served(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, list[Path]]:
    root = tmp_path_factory.mktemp(request.param)
    base = model_dir if request.param == "llama" else qwen2_moe(root / "model")
    folders = []
    for i, (rank, modules, params) in enumerate(ADAPTERS[request.param]):
        torch.manual_seed(20 + i)
        config = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=modules,
            target_parameters=params or None,
            init_lora_weights=False,
        )
        model = get_peft_model(load_base(base), config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.mul_(0.3)
        model.save_pretrained(root / f"a{i}", save_embedding_layers=False)
        folders.append(root / f"a{i}")
    return request.param, base, folders


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_rank_classes_mix_in_one_batch_as_peft(
    served: tuple[str, Path, list[Path]], native: bool
) -> None:
    kind, model_dir, folders = served
    model = load_base(model_dir)
    dec = Decoder(model, native=native)
    banks = expert_banks(model)
    with torch.inference_mode():
        for i, folder in enumerate(folders):
            config, tensors = read_peft_dir(folder)
            check_fits(tensors, config, linear_shapes(model), 64, banks)
            dec.install(f"a{i}", dec.lay_out(adapter_weights(config, tensors, banks)))
    assert dec.capacity == CLASSES[kind]
    expert_stacks = [s for s, _ in dec.targets.values() if isinstance(s, ExpertStacks)]
    assert len(expert_stacks) == (2 if kind == "qwen2-moe" else 0)  # one MoE layer
    for stacks in expert_stacks:
        assert {r: a.shape[:2] + a.shape[3:] for r, a in stacks.a.items()} == {
            r: (n, stacks.experts, r) for r, n in CLASSES[kind].items()
        }

    rows = ["a1", "a0", None, "a1", "a2", "a0", "a0"]
    ids = torch.randint(3, 300, (len(rows), 7), generator=torch.Generator().manual_seed(3))
    count, length = ids.shape
    dec.cache.reserve(count, length)
    with torch.inference_mode():
        for r, name in enumerate(rows):
            shape = (dec.kv_heads, length - 1, dec.head_dim)
            keys = [torch.zeros(shape) for _ in dec.layers]
            values = [torch.zeros(shape) for _ in dec.layers]
            prompt = ids[r, :-1]
            dec.prefill([PrefillPart(prompt, 0, keys, values, dec.slot(name), len(prompt))])
            kv = torch.stack([torch.stack([k, v]) for k, v in zip(keys, values, strict=True)])
            dec.cache.fill(slice(r, r + 1), kv)
        route = make_route([dec.slot(name) for name in rows])
        pos = torch.full((count,), length - 1)
        last = torch.log_softmax(dec.decode(ids[:, -1], pos, pos, length, route, []), dim=-1)
        for r, name in enumerate(rows):
            ref = reference_model(model_dir, None if name is None else folders[int(name[1])])
            alone = torch.log_softmax(ref(input_ids=ids[r : r + 1]).logits[0, -1], dim=-1)
            assert (last[r] - alone).abs().max() <= 1e-4, name
