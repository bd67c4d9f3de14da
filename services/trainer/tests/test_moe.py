"""MoE expert LoRA on the tiny Qwen3-MoE: per token, per expert, per slot, equal to PEFT.

The reference is PEFT's own `target_parameters` LoRA on the fused expert banks (pinned PEFT
0.21.2 supports 3-D expert parameters), holding exactly one slot's adapter, run datum by
datum; the engine runs four slots' datums in one mixed batch, each token going through its
own slot's adapter on the experts the router picked for it. A slot with `share_experts`
is checked against PEFT holding its adapter repeated on every expert (its gradient is the
sum of the per-expert ones).
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.errors import FailedPrecondition
from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)

TOL = 1e-5
VOCAB = 2048
SPECS = {
    0: LoraSpec(rank=4, alpha=8, seed=1),  # attention + per-expert banks
    1: LoraSpec(rank=4, seed=2, train_attn=False, share_experts=True),  # one adapter, all experts
    2: LoraSpec(rank=2, seed=3, target_modules=("experts.down_proj", "q_proj")),
    3: LoraSpec(rank=2, seed=4, train_mlp=False),  # no bank adapter: its tokens see the base
}


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within 1e-5, relative to the reference's largest entry when that exceeds 1."""
    return got.shape == want.shape and bool(
        (got - want).abs().max() <= TOL * max(1.0, float(want.abs().max()))
    )


def datum(gen: torch.Generator, n: int, loss_fn: str) -> Datum:
    tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
    inputs = {"target_tokens": torch.randint(0, VOCAB, (n,), generator=gen)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = torch.randn(n, generator=gen)
    else:
        inputs["logprobs"] = -7.0 + 0.5 * torch.randn(n, generator=gen)
        inputs["advantages"] = torch.randn(n, generator=gen)
    return Datum(tokens, inputs)


def ref_loss(loss_fn: str, lp: torch.Tensor, inputs: dict) -> torch.Tensor:
    if loss_fn == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    return -(torch.exp(lp - inputs["logprobs"]) * inputs["advantages"]).sum()


def peft_reference(engine, slot: int, folder):
    """PEFT (target_modules + target_parameters) holding exactly the slot's adapter."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    b = engine.slots.bindings[slot]
    kinds = {s.name: s.kind for s in engine.sites}
    base = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    cfg = LoraConfig(
        r=b.spec.rank,
        lora_alpha=b.spec.effective_alpha,
        target_modules=[t for t in b.targets if kinds[t] == "linear"],
        target_parameters=[t for t in b.targets if kinds[t] == "experts"] or None,
    )
    pm = get_peft_model(base, cfg)
    result = set_peft_model_state_dict(pm, engine.layout.tensors(b))
    assert not result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k]
    return pm.eval()


def engine_grads(engine, slot: int) -> dict[str, torch.Tensor]:
    """The slot's gradients in PEFT's layout; a shared bank's as its single block."""
    b = engine.slots.bindings[slot]
    grads = {}
    from lorafleet_trainer.targets import peft_prefixes

    prefixes = peft_prefixes(b.targets, engine.sites)
    for name in b.targets:
        ga, gb = b.a[name].grad, b.b[name].grad
        if ga.dim() == 3:
            ga, gb = engine.wrappers[name].to_peft(ga, gb)
        grads[f"{prefixes[name]}.lora_A.weight"] = ga
        grads[f"{prefixes[name]}.lora_B.weight"] = gb
    return grads


def fold_shared(engine, slot: int, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's per-expert gradients of a repeated adapter, summed over experts."""
    b = engine.slots.bindings[slot]
    if not b.spec.share_experts:
        return grads
    out = dict(grads)
    for key, g in grads.items():
        if ".experts" not in key:
            continue
        if ".lora_A." in key:
            out[key] = g.reshape(8, -1, g.shape[-1]).sum(0)
        else:
            out[key] = g.reshape(g.shape[0], -1, 8).sum(-1)
    return out


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_mixed_slot_expert_lora_equals_peft(moe_model_dir, engine_for, h, loss_fn) -> None:
    engine = engine_for(moe_model_dir)
    for slot, spec in SPECS.items():
        engine.bind(slot, f"r{slot}", spec)
        h.perturb(engine, slot, seed=50 + slot, scale=0.1)
    assert engine.slots.bindings[1].a["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128)
    assert engine.slots.bindings[0].a["model.layers.0.mlp.experts.gate_up_proj"].shape == (
        8,
        4,
        128,
    )
    gen = torch.Generator().manual_seed(9)
    data = {s: [datum(gen, n, loss_fn) for n in (7, 12)] for s in SPECS}
    items = [
        ForwardBackwardItem(f"op{s}", s, f"r{s}", ForwardBackwardInput(data[s], loss_fn))
        for s in (2, 0, 3, 1)
    ]
    results = engine.forward_backward(items)
    for item, out in zip(items, results, strict=True):
        s = item.slot
        pm = peft_reference(engine, s, moe_model_dir)
        for got, d in zip(out.logprobs, data[s], strict=True):
            logits = pm(input_ids=torch.tensor([d.tokens])).logits[0].float()
            t = d.loss_fn_inputs["target_tokens"]
            lp = torch.log_softmax(logits, -1).gather(-1, t.view(-1, 1)).view(-1)
            ref_loss(loss_fn, lp, d.loss_fn_inputs).backward()
            assert close(got, lp.detach()), s
        want = fold_shared(engine, s, h.peft_grads(pm))
        got = engine_grads(engine, s)
        assert got.keys() == want.keys()
        for key in got:
            assert close(got[key], want[key]), key
        assert all(g.abs().max() > 0 for k, g in got.items() if "lora_A" in k), s


def _forward_only(engine, slot: int, tokens: list[int]) -> torch.Tensor:
    d = Datum(tokens, {"target_tokens": torch.tensor(tokens), "weights": torch.ones(len(tokens))})
    item = ForwardBackwardItem(
        "", slot, f"r{slot}", ForwardBackwardInput([d], "cross_entropy", forward_only=True)
    )
    return engine.forward_backward([item])[0].logprobs[0]


def test_export_loads_in_peft_and_state_round_trips(moe_model_dir, engine_for, h, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = engine_for(moe_model_dir)
    for slot in (0, 1):
        engine.bind(slot, f"r{slot}", SPECS[slot])
        h.perturb(engine, slot, seed=70 + slot, scale=0.1)
    tokens = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(2)).tolist()
    for slot in (0, 1):
        folder = tmp_path / f"export{slot}"
        engine.export_adapter(slot, f"r{slot}", folder)
        base = AutoModelForCausalLM.from_pretrained(str(moe_model_dir), dtype=torch.float32)
        pm = PeftModel.from_pretrained(base, str(folder)).eval()
        with torch.no_grad():
            logits = pm(input_ids=torch.tensor([tokens])).logits[0].float()
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).view(-1, 1)).view(-1)
        assert close(_forward_only(engine, slot, tokens), want), slot

    # A trained step, saved and loaded into a fresh engine, continues identically.
    gen = torch.Generator().manual_seed(5)
    for slot in (0, 1):
        d = [datum(gen, 9, "cross_entropy")]
        engine.forward_backward(
            [ForwardBackwardItem("fb", slot, f"r{slot}", ForwardBackwardInput(d, "cross_entropy"))]
        )
        engine.optim_step("step", slot, f"r{slot}", AdamParams(learning_rate=1e-2))
    refs = {s: engine.save_state("save", s, f"r{s}", f"s{s}", True) for s in (0, 1)}
    other = engine_for(moe_model_dir)
    for slot in (0, 1):
        other.bind(slot, f"r{slot}", SPECS[slot])
        other.load_state("load", slot, f"r{slot}", refs[slot], True)
        assert torch.equal(_forward_only(other, slot, tokens), _forward_only(engine, slot, tokens))
    # A per-expert state does not fit a shared slot: refused, nothing changed.
    per_expert = LoraSpec(rank=4, seed=2, train_attn=False)
    engine.bind(2, "r2", per_expert)
    ref = engine.save_state("save", 2, "r2", "per-expert", False)
    other.bind(2, "r2", SPECS[1])
    before = h.snapshot(other)
    with pytest.raises(FailedPrecondition) as err:
        other.load_state("bad", 2, "r2", ref, False)
    assert err.value.reason == "SHARED_EXPERTS_MISMATCH"
    h.assert_same(before, h.snapshot(other))
