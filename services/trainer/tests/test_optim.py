"""optim_step equals torch.optim.AdamW; the non-finite veto; LoRA+ and A-only decay."""

from __future__ import annotations

import math

import pytest
import torch

from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)


def fb(engine, slot: int, op: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    data = [
        Datum(
            torch.randint(0, 256, (6,), generator=gen).tolist(),
            {
                "target_tokens": torch.randint(0, 256, (6,), generator=gen),
                "weights": torch.rand(6, generator=gen),
            },
        )
    ]
    (out,) = engine.forward_backward(
        [ForwardBackwardItem(op, slot, f"r{slot}", ForwardBackwardInput(data, "cross_entropy"))]
    )
    assert not isinstance(out, Exception)


@pytest.mark.parametrize(
    ("call_clip", "default_clip", "clip"),
    # (the call's grad_clip_norm, None = unset; the run's max_grad_norm_default; the clip that
    # must apply): an explicit 0 (a managed job's max_grad_norm=0) is never overridden
    [
        (None, 0.0, 0.0),
        (0.05, 0.0, 0.05),
        (None, 0.05, 0.05),
        (0.05, 10.0, 0.05),
        (0.0, 0.05, 0.0),
    ],
)
def test_optim_step_equals_torch_adamw(
    make_engine, h, call_clip: float | None, default_clip: float, clip: float
) -> None:
    engine = make_engine()
    engine.bind(0, "r0", LoraSpec(rank=4, seed=1, max_grad_norm_default=default_clip))
    engine.bind(1, "r1", LoraSpec(rank=2, seed=2))
    h.perturb(engine, 0, seed=3)
    binding = engine.slots.bindings[0]
    ref_params = [p.detach().clone().requires_grad_(True) for p in binding.optimizer.params]
    ref_opt = torch.optim.AdamW(ref_params, lr=1e-3)
    hps = [
        AdamParams(2e-3, 0.9, 0.95, 1e-8, 0.1, call_clip),
        AdamParams(1e-3, 0.8, 0.99, 1e-12, 0.0, call_clip),
        AdamParams(5e-4, 0.9, 0.95, 1e-6, 0.01, call_clip),
    ]
    for step, hp in enumerate(hps):
        fb(engine, 0, f"fb{step}", seed=step)
        fb(engine, 1, f"fb{step}", seed=step)
        other = h.snapshot(engine)[1]
        for p, q in zip(ref_params, binding.optimizer.params, strict=True):
            p.grad = q.grad.clone()
        if clip:
            torch.nn.utils.clip_grad_norm_(ref_params, clip)
        for group in ref_opt.param_groups:
            group.update(
                lr=hp.learning_rate,
                betas=(hp.beta1, hp.beta2),
                eps=hp.eps,
                weight_decay=hp.weight_decay,
            )
        ref_opt.step()
        result = engine.optim_step(f"step{step}", 0, "r0", hp)
        assert result.applied and result.metrics["step"] == step + 1
        for p, q in zip(ref_params, binding.optimizer.params, strict=True):
            assert (p.detach() - q.detach()).abs().max().item() <= 1e-6
            assert q.grad is None
        # The other slot is bit-identical: its weights, pending gradients and moments.
        h.assert_same([other], [h.snapshot(engine)[1]])
        engine.optim_step(f"step{step}", 1, "r1", hp)


def test_nonfinite_gradient_vetoes_and_changes_nothing(make_engine, h) -> None:
    engine = make_engine()
    engine.bind(0, "r0", LoraSpec(rank=4, seed=1))
    h.perturb(engine, 0, seed=3)
    fb(engine, 0, "fb0", seed=0)
    assert engine.optim_step("s0", 0, "r0", AdamParams(learning_rate=1e-3)).applied
    fb(engine, 0, "fb1", seed=1)
    binding = engine.slots.bindings[0]
    binding.optimizer.params[3].grad[0, 0] = math.inf  # a poisoned window
    before = h.snapshot(engine)[0]
    result = engine.optim_step("s1", 0, "r0", AdamParams(learning_rate=1e-3))
    assert not result.applied and "non-finite" in result.note
    after = h.snapshot(engine)[0]
    assert all(g is None for g in after["grads"])
    for key in ("weights", "moments", "steps"):
        h.assert_same([{key: before[key]}], [{key: after[key]}])
    # Nothing pending now: the next step is a no-op that says so.
    noop = engine.optim_step("s2", 0, "r0", AdamParams(learning_rate=1e-3))
    assert not noop.applied and "no accumulated gradient" in noop.note


def test_lora_plus_and_a_only_decay(make_engine, h) -> None:
    """First AdamW step: m̂ = g, v̂ = g², so update = g / (|g| + eps), written out by hand."""
    engine = make_engine()
    spec = LoraSpec(rank=4, seed=1, lora_plus_ratio=4.0, a_only_weight_decay=True)
    engine.bind(0, "r0", spec)
    h.perturb(engine, 0, seed=3)
    fb(engine, 0, "fb0", seed=0)
    binding = engine.slots.bindings[0]
    lr, wd, eps = 1e-2, 0.5, 1e-8
    expected = []
    for name in binding.targets:
        a, b = binding.a[name], binding.b[name]
        expected.append(a.detach() * (1 - lr * wd) - lr * a.grad / (a.grad.abs() + eps))
        expected.append(b.detach() - 4 * lr * b.grad / (b.grad.abs() + eps))
    engine.optim_step("s0", 0, "r0", AdamParams(lr, 0.9, 0.95, eps, wd, 0.0))
    got = []
    for name in binding.targets:
        got.extend([binding.a[name].detach(), binding.b[name].detach()])
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max().item() <= 1e-6


def test_extensions_off_decays_both(make_engine, h) -> None:
    engine = make_engine()
    engine.bind(0, "r0", LoraSpec(rank=4, seed=1))
    h.perturb(engine, 0, seed=3)
    fb(engine, 0, "fb0", seed=0)
    binding = engine.slots.bindings[0]
    name = binding.targets[0]
    b, g = binding.b[name].detach().clone(), binding.b[name].grad.clone()
    engine.optim_step("s0", 0, "r0", AdamParams(1e-2, 0.9, 0.95, 1e-8, 0.5, 0.0))
    expected = b * (1 - 1e-2 * 0.5) - 1e-2 * g / (g.abs() + 1e-8)
    assert (binding.b[name].detach() - expected).abs().max().item() <= 1e-6


def test_step_a_only_decay_overrides_the_run(make_engine, h) -> None:
    """A managed job's steps set a_only_weight_decay (juno: B is never decayed) whatever the
    run says; a step that leaves it unset follows the run."""
    for run_flag, step_flag, b_decayed in (
        (False, True, False),
        (True, False, True),
        (False, None, True),
        (True, None, False),
    ):
        engine = make_engine()
        engine.bind(0, "r0", LoraSpec(rank=4, seed=1, a_only_weight_decay=run_flag))
        h.perturb(engine, 0, seed=3)
        fb(engine, 0, "fb0", seed=0)
        binding = engine.slots.bindings[0]
        name = binding.targets[0]
        b, g = binding.b[name].detach().clone(), binding.b[name].grad.clone()
        hp = AdamParams(1e-2, 0.9, 0.95, 1e-8, 0.5, 0.0, a_only_weight_decay=step_flag)
        engine.optim_step("s0", 0, "r0", hp)
        decay = 1 - 1e-2 * 0.5 if b_decayed else 1.0
        expected = b * decay - 1e-2 * g / (g.abs() + 1e-8)
        assert (binding.b[name].detach() - expected).abs().max().item() <= 1e-6, (
            run_flag,
            step_flag,
        )
