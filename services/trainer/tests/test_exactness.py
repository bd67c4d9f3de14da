"""Logprobs and gradients equal an in-process PEFT computation, for every loss.

The reference runs each datum alone through a float64 PEFT model holding just that slot's
adapter, with the Tinker loss formulas written out independently here; the engine runs all
slots' datums together in one mixed float32 batch.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)

TOL = 1e-5
RTOL = 1e-6  # about 8 float32 ulps of the tensor's scale
VOCAB = 256


def ref_loss(loss_fn: str, lp, inputs, cfg):
    """Tinker's formulas (tinker-api.md §7.3), written independently of the engine."""
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    if loss_fn == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    old, adv = inputs["logprobs"], inputs["advantages"]
    r = torch.exp(lp - old)
    if loss_fn == "importance_sampling":
        return -(r * adv).sum()
    if loss_fn == "ppo":
        return -torch.min(r * adv, torch.clamp(r, lo, hi) * adv).sum()
    if loss_fn == "cispo":
        return -(torch.clamp(r, lo, hi).detach() * lp * adv).sum()
    if loss_fn == "dro":
        beta = cfg.get("beta", 0.05)
        return -(lp * adv).sum() + beta / 2 * ((lp - old) ** 2).sum()
    assert loss_fn == "gspo"
    m = inputs.get("sequence_ratio_mask", torch.ones_like(lp))
    s = torch.exp(((lp - old) * m).sum() / m.sum())
    return -(m * torch.min(s * adv, torch.clamp(s, lo, hi) * adv)).sum()


def make_datum(gen: torch.Generator, n: int, loss_fn: str, k: int = 0) -> Datum:
    tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
    shape = (n, k) if k else (n,)
    inputs = {"target_tokens": torch.randint(0, VOCAB, shape, generator=gen)}
    if loss_fn == "cross_entropy":
        inputs["weights"] = torch.randn(shape, generator=gen)  # negatives included
    else:
        # Sampler logprobs near the model's (about -5.5 for a random 256-token model) so that
        # ratios straddle the clip range.
        inputs["logprobs"] = -5.5 + 0.4 * torch.randn(n, generator=gen)
        inputs["advantages"] = torch.randn(n, generator=gen)
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (torch.rand(n, generator=gen) > 0.3).float()
    return Datum(tokens, inputs)


def reference(h, engine, slot, batches, loss_fn, cfg):
    """Per-datum PEFT logprobs and the gradient summed over `batches` (lists of datums)."""
    pm = h.peft_model(engine, slot, torch.float64)
    logprobs = []
    for data in batches:
        for d in data:
            ids = torch.tensor([d.tokens])
            logits = pm(input_ids=ids).logits[0]
            lp_all = torch.log_softmax(logits, -1)
            t = d.loss_fn_inputs["target_tokens"]
            lp = lp_all.gather(-1, t.view(len(d.tokens), -1)).view(t.shape)
            ref_loss(loss_fn, lp, d.loss_fn_inputs, cfg).backward()
            logprobs.append(lp.detach())
    return logprobs, h.peft_grads(pm)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """`got` (the engine, float32) is within float32 reach of `want` (float64, exact).

    The bound is TOL plus RTOL of the tensor's largest magnitude: a float32 sum of many
    mixed-sign terms is only as exact as the scale of its terms, and which rounding a sum
    gets depends on the CPU's GEMM kernels (AVX-512 and AVX2 builds of MKL block their sums
    differently), so no absolute bound on values near 15-50 holds on every CPU."""
    assert got.shape == want.shape
    bound = TOL + RTOL * want.double().abs().max().item()
    assert (got.double() - want.double()).abs().max().item() <= bound


SPECS = [
    LoraSpec(rank=4, alpha=8, seed=11, train_attn=True, train_mlp=True),
    LoraSpec(
        rank=2,
        seed=12,
        target_modules=("q_proj", "v_proj", "down_proj"),
        exclude_modules=("model.layers.0.self_attn.v_proj",),
        train_unembed=True,
    ),
]


@pytest.mark.parametrize(
    ("loss_fn", "cfg"),
    [
        ("cross_entropy", {}),
        ("importance_sampling", {}),
        ("ppo", {}),
        ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
        ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
        ("dro", {"beta": 0.3}),
        ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    ],
)
def test_mixed_slot_batch_matches_peft(make_engine, h, loss_fn, cfg) -> None:
    engine = make_engine()
    for slot, spec in enumerate(SPECS):
        engine.bind(slot, f"r{slot}", spec)
        h.perturb(engine, slot, seed=100 + slot)
    gen = torch.Generator().manual_seed(7)
    data = {
        0: [make_datum(gen, n, loss_fn) for n in (5, 9)],
        1: [make_datum(gen, n, loss_fn) for n in (7, 3, 6)],
    }
    items = [
        ForwardBackwardItem(f"op{s}", s, f"r{s}", ForwardBackwardInput(data[s], loss_fn, cfg))
        for s in (1, 0)
    ]
    results = engine.forward_backward(items)
    for item, out in zip(items, results, strict=True):
        s = item.slot
        ref_lp, ref_grads = reference(h, engine, s, [data[s]], loss_fn, cfg)
        for got, want in zip(out.logprobs, ref_lp, strict=True):
            assert_close(got, want)
        want_loss = sum(
            float(ref_loss(loss_fn, lp, d.loss_fn_inputs, cfg))
            for lp, d in zip(ref_lp, data[s], strict=True)
        )
        assert abs(out.metrics["loss:sum"] - want_loss) <= 1e-4 * max(1.0, abs(want_loss))
        grads = h.slot_grads(engine, s)
        assert grads.keys() == ref_grads.keys()
        for key in grads:
            assert_close(grads[key], ref_grads[key])
        assert any(g.abs().max() > 0 for g in grads.values())


def test_topk_cross_entropy_and_accumulation_over_calls(make_engine, h) -> None:
    """(N, K) targets; three calls accumulate into exactly the summed gradient."""
    engine = make_engine()
    engine.bind(0, "r0", SPECS[0])
    engine.bind(1, "r1", SPECS[1])
    h.perturb(engine, 0, seed=1)
    h.perturb(engine, 1, seed=2)
    gen = torch.Generator().manual_seed(3)
    batches = [
        [make_datum(gen, 6, "cross_entropy", k=3)],
        [make_datum(gen, 4, "cross_entropy")],
        [make_datum(gen, 8, "cross_entropy", k=2), make_datum(gen, 2, "cross_entropy")],
    ]
    got_lp = []
    for i, batch in enumerate(batches):
        items = [
            ForwardBackwardItem(f"a{i}", 0, "r0", ForwardBackwardInput(batch, "cross_entropy")),
            ForwardBackwardItem(
                f"b{i}", 1, "r1", ForwardBackwardInput(batches[0], "cross_entropy")
            ),
        ]
        out = engine.forward_backward(items)
        got_lp.extend(out[0].logprobs)
    ref_lp, ref_grads = reference(h, engine, 0, batches, "cross_entropy", {})
    for got, want in zip(got_lp, ref_lp, strict=True):
        assert_close(got, want)
    grads = h.slot_grads(engine, 0)
    for key in grads:
        assert_close(grads[key], ref_grads[key])
    # Slot 1 saw batches[0] three times: its gradient is three times the single one.
    _, once = reference(h, engine, 1, [batches[0]], "cross_entropy", {})
    for key, g in h.slot_grads(engine, 1).items():
        assert_close(g, 3 * once[key])


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "ppo"])
def test_accumulation_over_calls_is_one_call_bit_for_bit(make_engine, h, loss_fn) -> None:
    """Three forward_backward calls then one optim_step equal one call with the same data,
    bit for bit (SkyRL's accumulation test asks 1e-6): each call's gradient is added to the
    float64 sum the earlier calls left, which is rounded to float32 once, as one call's is.
    The datums share a length, so the base model's own computation is the same either way
    (lora.py: a row's rounding depends on the batch's width)."""
    engine = make_engine()
    spec = LoraSpec(rank=4, seed=11, alpha=8.0)
    engine.bind(0, "split", spec)
    engine.bind(1, "whole", spec)
    h.perturb(engine, 0, seed=5)
    h.perturb(engine, 1, seed=5)
    gen = torch.Generator().manual_seed(9)
    data = [make_datum(gen, 12, loss_fn) for _ in range(6)]
    for i in range(3):
        batch = data[2 * i : 2 * i + 2]
        item = ForwardBackwardItem(f"s{i}", 0, "split", ForwardBackwardInput(batch, loss_fn))
        assert not isinstance(engine.forward_backward([item])[0], Exception)
    item = ForwardBackwardItem("w", 1, "whole", ForwardBackwardInput(data, loss_fn))
    assert not isinstance(engine.forward_backward([item])[0], Exception)
    split, whole = h.slot_grads(engine, 0), h.slot_grads(engine, 1)
    for key in whole:
        assert torch.equal(split[key], whole[key]), key
    hp = AdamParams(learning_rate=1e-2)
    assert engine.optim_step("o0", 0, "split", hp).applied
    assert engine.optim_step("o1", 1, "whole", hp).applied
    after = [engine.layout.tensors(engine.slots.bindings[s]) for s in (0, 1)]
    for key in after[1]:
        assert torch.equal(after[0][key], after[1][key]), key


def test_forward_only_leaves_gradients_alone(make_engine, h) -> None:
    engine = make_engine()
    engine.bind(0, "r0", SPECS[0])
    h.perturb(engine, 0, seed=1)
    gen = torch.Generator().manual_seed(3)
    data = [make_datum(gen, 5, "cross_entropy")]
    before = h.snapshot(engine)
    out = engine.forward_backward(
        [
            ForwardBackwardItem(
                "", 0, "r0", ForwardBackwardInput(data, "cross_entropy", forward_only=True)
            )
        ]
    )
    h.assert_same(before, h.snapshot(engine))
    ref_lp, _ = reference(h, engine, 0, [data], "cross_entropy", {})
    assert_close(out[0].logprobs[0], ref_lp[0])


def test_duplicate_operation_id_is_applied_once(make_engine, h) -> None:
    engine = make_engine()
    engine.bind(0, "r0", SPECS[0])
    h.perturb(engine, 0, seed=1)
    gen = torch.Generator().manual_seed(5)
    item = ForwardBackwardItem(
        "op", 0, "r0", ForwardBackwardInput([make_datum(gen, 5, "ppo")], "ppo")
    )
    first = engine.forward_backward([item, item])
    assert first[0] is first[1]
    grads = h.slot_grads(engine, 0)
    again = engine.forward_backward([item])
    assert again[0] is first[0]
    for key, g in h.slot_grads(engine, 0).items():
        assert torch.equal(g, grads[key])
    assert engine.slots.bindings[0].tokens_trained == 5


def test_equal_rank_slots_batched_by_units_match_peft(make_engine, h) -> None:
    """Three rank-4 slots with 2, 4 and 2 datums, plus a forward-only item of slot 0 (a
    second group of the same slot), run as bmm units of two rows each (the gathered path);
    slot 2 skips some modules."""
    engine = make_engine()
    specs = [
        LoraSpec(rank=4, alpha=8, seed=21, train_attn=True, train_mlp=True),
        LoraSpec(rank=4, alpha=12, seed=22, train_attn=True, train_mlp=True),
        LoraSpec(rank=4, seed=23, target_modules=("q_proj", "up_proj"), train_unembed=True),
    ]
    for slot, spec in enumerate(specs):
        engine.bind(slot, f"r{slot}", spec)
        h.perturb(engine, slot, seed=200 + slot)
    gen = torch.Generator().manual_seed(9)
    data = {
        s: [make_datum(gen, n, "cross_entropy") for n in sizes]
        for s, sizes in {0: (7, 4), 1: (5, 8, 3, 6), 2: (9, 2)}.items()
    }
    probe = [make_datum(gen, 6, "cross_entropy"), make_datum(gen, 3, "cross_entropy")]
    items = [
        ForwardBackwardItem(f"op{s}", s, f"r{s}", ForwardBackwardInput(data[s], "cross_entropy"))
        for s in (1, 0, 2)
    ] + [ForwardBackwardItem("", 0, "r0", ForwardBackwardInput(probe, "cross_entropy", {}, True))]
    results = engine.forward_backward(items)
    for item, out in zip(items[:3], results[:3], strict=True):
        s = item.slot
        ref_lp, ref_grads = reference(h, engine, s, [data[s]], "cross_entropy", {})
        for got, want in zip(out.logprobs, ref_lp, strict=True):
            assert_close(got, want)
        grads = h.slot_grads(engine, s)
        assert grads.keys() == ref_grads.keys()
        for key in grads:
            assert_close(grads[key], ref_grads[key])
    probe_lp, _ = reference(h, engine, 0, [probe], "cross_entropy", {})
    for got, want in zip(results[3].logprobs, probe_lp, strict=True):
        assert_close(got, want)


def test_dropout_in_a_mixed_batch_equals_dropout_alone(make_engine, h) -> None:
    """Hashed masks are per row: a slot's dropout gradient does not depend on which other
    slots (with other drop probabilities, or none) share its batch."""
    specs = [
        LoraSpec(rank=4, seed=31, dropout=0.3, train_attn=True, train_mlp=True),
        LoraSpec(rank=4, seed=32, dropout=0.1, train_attn=True, train_mlp=True),
        LoraSpec(rank=2, seed=33, train_attn=True, train_mlp=True),
    ]
    gen = torch.Generator().manual_seed(4)
    data = [[make_datum(gen, n, "cross_entropy") for n in (6, 8)] for _ in specs]

    def grads_of_slot0(slots: list[int]) -> dict[str, torch.Tensor]:
        engine = make_engine()
        for s in slots:
            engine.bind(s, f"r{s}", specs[s])
            h.perturb(engine, s, seed=300 + s)
        engine.forward_backward(
            [
                ForwardBackwardItem(
                    "op", s, f"r{s}", ForwardBackwardInput(data[s], "cross_entropy")
                )
                for s in slots
            ]
        )
        return h.slot_grads(engine, 0)

    alone, mixed = grads_of_slot0([0]), grads_of_slot0([2, 1, 0])
    engine = make_engine()
    engine.bind(0, "r0", LoraSpec(rank=4, seed=31, train_attn=True, train_mlp=True))
    h.perturb(engine, 0, seed=300)
    engine.forward_backward(
        [ForwardBackwardItem("op", 0, "r0", ForwardBackwardInput(data[0], "cross_entropy"))]
    )
    no_dropout = h.slot_grads(engine, 0)
    for key in alone:
        assert_close(mixed[key], alone[key])
    assert any((alone[k] - no_dropout[k]).abs().max() > 1e-3 for k in alone)


def test_forward_only_passes_run_without_dropout(make_engine, h) -> None:
    """Dropout is train-only (juno §11.4): a forward-only pass (validation, `forward`) of a
    slot with dropout 0.5 gives the logprobs of the same adapter without dropout, bit for
    bit, while its forward_backward's logprobs show the masks."""
    gen = torch.Generator().manual_seed(8)
    data = [make_datum(gen, n, "cross_entropy") for n in (7, 7)]
    engine = make_engine()
    for slot, dropout in ((0, 0.5), (1, 0.0)):
        engine.bind(slot, f"r{slot}", LoraSpec(rank=4, seed=21, dropout=dropout))
        h.perturb(engine, slot, seed=77)

    calls = iter(range(100))

    def logprobs(slot: int, forward_only: bool) -> list[torch.Tensor]:
        fbi = ForwardBackwardInput(data, "cross_entropy", forward_only=forward_only)
        item = ForwardBackwardItem(f"op{next(calls)}", slot, f"r{slot}", fbi)
        (out,) = engine.forward_backward([item])
        assert not isinstance(out, Exception)
        return out.logprobs

    for got, want in zip(logprobs(0, True), logprobs(1, True), strict=True):
        assert torch.equal(got, want)
    trained = logprobs(0, False)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(trained, logprobs(1, True), strict=True))
