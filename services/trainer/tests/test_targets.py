"""Never silently skip: a registration adapts exactly what it asks for, or is refused.

Fused projections (Phi-3's qkv_proj and gate_up_proj) are adapted and equal PEFT on the
same modules; matrices we cannot adapt (GPT-2's Conv1D, an MoE router's raw weight) are
named in the refusal, and nothing changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafleet.errors import InvalidArgument
from lorafleet_trainer.domain import Datum, ForwardBackwardInput, ForwardBackwardItem, LoraSpec

TOL = 1e-5


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within 1e-5, relative to the reference's largest entry when that exceeds 1."""
    return got.shape == want.shape and bool(
        (got - want).abs().max() <= TOL * max(1.0, float(want.abs().max()))
    )


def ce_datum(gen: torch.Generator, n: int, vocab: int) -> Datum:
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return Datum(
        tokens,
        {
            "target_tokens": torch.randint(0, vocab, (n,), generator=gen),
            "weights": torch.rand(n, generator=gen),
        },
    )


def test_phi3_fused_projections_are_adapted_and_equal_peft(
    phi3_model_dir, engine_for, helpers_for
) -> None:
    engine = engine_for(phi3_model_dir)
    h = helpers_for(phi3_model_dir)
    engine.bind(0, "r0", LoraSpec(rank=4, alpha=8, seed=3))
    engine.bind(1, "r1", LoraSpec(rank=2, seed=4, target_modules=("qkv_proj", "gate_up_proj")))
    targets = engine.slots.bindings[0].targets
    for layer in range(2):
        for proj in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert f"model.layers.{layer}.{proj}" in targets
    assert len(targets) == 8
    assert len(engine.slots.bindings[1].targets) == 4
    for slot in (0, 1):
        h.perturb(engine, slot, seed=10 + slot)
    gen = torch.Generator().manual_seed(1)
    data = {s: [ce_datum(gen, n, 2048) for n in (6, 9)] for s in (0, 1)}
    items = [
        ForwardBackwardItem(f"op{s}", s, f"r{s}", ForwardBackwardInput(data[s], "cross_entropy"))
        for s in (0, 1)
    ]
    results = engine.forward_backward(items)
    for s, out in zip((0, 1), results, strict=True):
        pm = h.peft_model(engine, s)
        for got, d in zip(out.logprobs, data[s], strict=True):
            lp = torch.log_softmax(pm(input_ids=torch.tensor([d.tokens])).logits[0].float(), -1)
            lp = lp.gather(-1, d.loss_fn_inputs["target_tokens"].view(-1, 1)).view(-1)
            (-(lp * d.loss_fn_inputs["weights"]).sum()).backward()
            assert close(got, lp.detach())
        want = h.peft_grads(pm)
        got = h.slot_grads(engine, s)
        assert got.keys() == want.keys()
        for key in got:
            assert close(got[key], want[key]), key


def _gpt2(folder: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def test_unadaptable_modules_are_refused_by_name(tmp_path, engine_for, h) -> None:
    """GPT-2's projections are Conv1D: asking for them names every one; nothing changes."""
    engine = engine_for(_gpt2(tmp_path / "gpt2"))
    engine.bind(0, "ok", LoraSpec(rank=2, train_attn=False, train_mlp=False, train_unembed=True))
    assert engine.slots.bindings[0].targets == ("lm_head",)
    before = h.snapshot(engine)
    for spec, field in (
        (LoraSpec(rank=2), "lora_config.train_attn"),
        (LoraSpec(rank=2, train_attn=False), "lora_config.train_mlp"),
        (LoraSpec(rank=2, target_modules=("c_attn",)), "lora_config.target_modules"),
        # Part of the request is adaptable (lm_head), part is not: refused all the same.
        (
            LoraSpec(rank=2, target_modules=("c_fc",), train_unembed=True),
            "lora_config.target_modules",
        ),
    ):
        with pytest.raises(InvalidArgument) as err:
            engine.bind(1, "r1", spec)
        assert err.value.field == field
        assert "Conv1D" in str(err.value)
        assert "transformer.h.1." in str(err.value)
        h.assert_same(before, h.snapshot(engine))
    with pytest.raises(InvalidArgument) as err:
        engine.bind(1, "r1", LoraSpec(rank=2, target_modules=("c_attn",)))
    names = str(err.value).split(": ", 1)[1]
    assert "transformer.h.0.attn.c_attn.weight" in names
    assert "transformer.h.1.attn.c_attn.weight" in names


def test_moe_flags_reach_the_experts_and_never_the_router(moe_model_dir, engine_for, h) -> None:
    engine = engine_for(moe_model_dir)
    engine.bind(0, "attn", LoraSpec(rank=2, train_mlp=False))
    engine.bind(1, "mlp", LoraSpec(rank=2, train_attn=False))
    attn = engine.slots.bindings[0].targets
    mlp = engine.slots.bindings[1].targets
    assert all(".self_attn." in t for t in attn) and len(attn) == 8
    assert mlp == tuple(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")
    )
    before = h.snapshot(engine)
    for spec, field in (
        (LoraSpec(rank=2, target_modules=("gate",)), "lora_config.target_modules"),
        (LoraSpec(rank=2, dropout=0.1), "lora_config.dropout"),
        (LoraSpec(rank=2, train_mlp=False, share_experts=True), "lora_config.share_experts"),
        (LoraSpec(rank=2, target_modules=("nope",)), "lora_config.target_modules"),
    ):
        with pytest.raises(InvalidArgument) as err:
            engine.bind(2, "r2", spec)
        assert err.value.field == field
        h.assert_same(before, h.snapshot(engine))
    with pytest.raises(InvalidArgument, match=r"model\.layers\.1\.mlp\.gate\.weight"):
        engine.bind(2, "r2", LoraSpec(rank=2, target_modules=("gate",)))


def test_explicit_targets_mean_exactly_those_modules(make_engine) -> None:
    """target_modules wins over Tinker's train_* flags: q_proj,v_proj with the SDK's default
    train_unembed=True adapts q and v only, never lm_head."""
    engine = make_engine()
    spec = LoraSpec(rank=2, target_modules=("q_proj", "v_proj"), train_unembed=True)
    engine.bind(0, "r0", spec)
    targets = engine.slots.bindings[0].targets
    assert targets and all(t.endswith((".q_proj", ".v_proj")) for t in targets)
    engine.bind(1, "r1", LoraSpec(rank=2, train_unembed=True))  # flags alone: lm_head too
    assert "lm_head" in engine.slots.bindings[1].targets


def test_unknown_target_names_are_all_named_with_the_valid_ones(make_engine) -> None:
    engine = make_engine()
    with pytest.raises(InvalidArgument) as err:
        engine.bind(0, "r0", LoraSpec(rank=2, target_modules=("wq", "v_proj", "wv")))
    assert err.value.field == "lora_config.target_modules"
    message = err.value.message
    assert "'wq', 'wv'" in message and "q_proj" in message and "lm_head" in message
    assert "juno's wq is q_proj, wv is v_proj" in message
    assert engine.slots.bindings[0] is None
