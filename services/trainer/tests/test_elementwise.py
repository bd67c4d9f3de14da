"""Per-token outputs (`elementwise_loss` next to `logprobs`) and the omitted-weights default.

Each loss's per-token terms are written out here independently of the engine and applied to
the engine's own logprobs: the engine's `elementwise_loss` must equal them, sum per datum to
the datum's loss and over the call to `loss:sum`, and read exactly 0.0 (sign bit included)
wherever a token contributes nothing.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.testing import fb_output, payload_bytes
from lorafleet.v1 import common_pb2, trainer_pb2
from lorafleet_trainer import convert
from lorafleet_trainer.domain import Datum, ForwardBackwardInput, ForwardBackwardItem, LoraSpec
from lorafleet_trainer.servicer import TrainerServicer

VOCAB = 256
SPECS = [
    LoraSpec(rank=4, alpha=8, seed=11, train_attn=True, train_mlp=True),
    LoraSpec(rank=2, seed=12, target_modules=("q_proj", "v_proj", "down_proj")),
]
CASES = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("cispo", {}),
    ("dro", {"beta": 0.3}),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
]


def ref_terms(loss_fn: str, lp: torch.Tensor, inputs: dict, cfg: dict) -> torch.Tensor:
    """Each target token's contribution to the summed loss (tinker-api.md §7.3)."""
    lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
    if loss_fn == "cross_entropy":
        return -lp * inputs.get("weights", torch.ones_like(lp))
    old, adv = inputs["logprobs"], inputs["advantages"]
    r = torch.exp(lp - old)
    if loss_fn == "importance_sampling":
        return -r * adv
    if loss_fn == "ppo":
        return -torch.min(r * adv, r.clamp(lo, hi) * adv)
    if loss_fn == "cispo":
        return -r.clamp(lo, hi) * lp * adv
    if loss_fn == "dro":
        return -lp * adv + cfg.get("beta", 0.05) / 2 * (lp - old) ** 2
    m = inputs.get("sequence_ratio_mask", torch.ones_like(lp))
    s = torch.exp(((lp - old) * m).sum() / m.sum())
    return -m * torch.min(s * adv, s.clamp(lo, hi) * adv)


def ref_loss(loss_fn: str, lp: torch.Tensor, inputs: dict, cfg: dict) -> float:
    """The datum's loss in its summed form, in float64."""
    lp = lp.double()
    inputs = {k: v.double() for k, v in inputs.items() if k != "target_tokens"}
    if loss_fn == "dro":
        old, adv = inputs["logprobs"], inputs["advantages"]
        return float(-(lp * adv).sum() + cfg["beta"] / 2 * ((lp - old) ** 2).sum())
    return float(ref_terms(loss_fn, lp, inputs, cfg).sum())


def make_datum(gen: torch.Generator, n: int, loss_fn: str, k: int = 0) -> Datum:
    """Random inputs with zeros planted where a token must contribute nothing."""
    tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
    shape = (n, k) if k else (n,)
    inputs = {"target_tokens": torch.randint(0, VOCAB, shape, generator=gen)}
    if loss_fn == "cross_entropy":
        w = torch.randn(shape, generator=gen)  # negatives included
        inputs["weights"] = torch.where(torch.rand(shape, generator=gen) < 0.3, 0.0, w)
    else:
        inputs["logprobs"] = -5.5 + 0.4 * torch.randn(n, generator=gen)
        adv = torch.randn(n, generator=gen)
        if loss_fn != "dro":  # dro's beta term is not zero at zero advantage
            adv[torch.rand(n, generator=gen) < 0.3] = 0.0
        inputs["advantages"] = adv
        if loss_fn == "gspo":
            inputs["sequence_ratio_mask"] = (torch.rand(n, generator=gen) > 0.3).float()
    return Datum(tokens, inputs)


def zero_positions(loss_fn: str, inputs: dict) -> torch.Tensor:
    if loss_fn == "cross_entropy":
        return inputs["weights"] == 0
    if loss_fn == "gspo":
        return (inputs["sequence_ratio_mask"] == 0) | (inputs["advantages"] == 0)
    if loss_fn == "dro":
        return torch.zeros_like(inputs["advantages"], dtype=torch.bool)
    return inputs["advantages"] == 0


def bound_engine(make_engine, h, specs=SPECS, seeds=(100, 101)):
    engine = make_engine()
    for slot, spec in enumerate(specs):
        engine.bind(slot, f"r{slot}", spec)
        h.perturb(engine, slot, seed=seeds[slot])
    return engine


@pytest.mark.parametrize(("loss_fn", "cfg"), CASES)
def test_elementwise_loss_is_each_tokens_term(make_engine, h, loss_fn, cfg) -> None:
    engine = bound_engine(make_engine, h)
    gen = torch.Generator().manual_seed(17)
    data = {0: [make_datum(gen, n, loss_fn) for n in (5, 9)], 1: []}
    if loss_fn == "cross_entropy":
        data[1].append(make_datum(gen, 6, loss_fn, k=3))  # top-K targets
        zero = make_datum(gen, 4, loss_fn)
        zero.loss_fn_inputs["weights"] = torch.zeros(4)
        data[1].append(zero)
    data[1].extend(make_datum(gen, n, loss_fn) for n in (7, 3))
    items = [
        ForwardBackwardItem(f"op{s}", s, f"r{s}", ForwardBackwardInput(data[s], loss_fn, cfg))
        for s in (1, 0)
    ]
    for item, out in zip(items, engine.forward_backward(items), strict=True):
        assert len(out.elementwise_loss) == len(item.input.data)
        total = 0.0
        for d, lp, el in zip(item.input.data, out.logprobs, out.elementwise_loss, strict=True):
            target_shape = tuple(d.loss_fn_inputs["target_tokens"].shape)
            assert el.dtype == torch.float32 and tuple(el.shape) == target_shape == lp.shape
            want = ref_terms(loss_fn, lp, d.loss_fn_inputs, cfg)
            assert torch.allclose(el, want, rtol=1e-6, atol=1e-6)
            scale = max(1.0, float(el.double().abs().sum()))
            assert abs(float(el.double().sum()) - ref_loss(loss_fn, lp, d.loss_fn_inputs, cfg)) <= (
                1e-6 * scale
            )
            zeros = zero_positions(loss_fn, d.loss_fn_inputs)
            assert bool((el[zeros] == 0).all()) and not bool(el[zeros].signbit().any())
            total += float(el.double().sum())
        assert abs(total - out.metrics["loss:sum"]) <= 1e-6 * max(1.0, abs(total))


@pytest.mark.parametrize("k", [0, 3])
def test_omitted_weights_train_like_explicit_ones(make_engine, h, k) -> None:
    """Two slots with identical adapters, each alone: bit-identical outputs and gradients."""
    engine = bound_engine(make_engine, h, specs=[SPECS[0], SPECS[0]], seeds=(5, 5))
    gen = torch.Generator().manual_seed(23)
    explicit = [make_datum(gen, n, "cross_entropy", k) for n in (6, 4)]
    for d in explicit:
        d.loss_fn_inputs["weights"] = torch.ones(d.loss_fn_inputs["target_tokens"].shape)
    omitted = [
        Datum(d.tokens, {"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in explicit
    ]
    outs = [
        engine.forward_backward(
            [ForwardBackwardItem("op", s, f"r{s}", ForwardBackwardInput(data, "cross_entropy"))]
        )[0]
        for s, data in ((0, explicit), (1, omitted))
    ]
    assert outs[0].metrics == outs[1].metrics
    for a, b in zip(
        outs[0].logprobs + outs[0].elementwise_loss,
        outs[1].logprobs + outs[1].elementwise_loss,
        strict=True,
    ):
        assert torch.equal(a, b)
    g0, g1 = h.slot_grads(engine, 0), h.slot_grads(engine, 1)
    assert all(torch.equal(g0[key], g1[key]) for key in g0)
    assert any(g.abs().max() > 0 for g in g0.values())


async def test_elementwise_loss_travels_in_the_grpc_response(make_engine, h) -> None:
    """The servicer's proto response carries both outputs per datum; weights may be omitted."""
    engine = bound_engine(make_engine, h, specs=[SPECS[0]])
    servicer = TrainerServicer(engine, "replica-test")
    targets = torch.tensor([3, 4, 5, 6], dtype=torch.int64)
    proto_datum = common_pb2.Datum(
        tokens=[2, 3, 4, 5], loss_fn_inputs={"target_tokens": convert.tensor_to_proto(targets)}
    )
    request = trainer_pb2.ForwardBackwardRequest(
        items=[
            trainer_pb2.ForwardBackwardItem(
                operation_id="op",
                slot=0,
                registration_id="r0",
                payload=payload_bytes(
                    common_pb2.ForwardBackwardInput(data=[proto_datum], loss_fn="cross_entropy")
                ),
            )
        ]
    )
    try:
        response = await servicer.ForwardBackward(request, None)
    finally:
        servicer.executor.shutdown()
    (result,) = response.results
    output = fb_output(result)
    outputs = output.outputs[0].outputs
    assert set(outputs) == {"logprobs", "elementwise_loss"}
    lp = convert.tensor_from_proto(outputs["logprobs"], "logprobs")
    el = convert.tensor_from_proto(outputs["elementwise_loss"], "elementwise_loss")
    assert el.shape == lp.shape == (4,)
    assert torch.allclose(el, -lp, rtol=0, atol=0)
    assert abs(float(el.double().sum()) - output.metrics["loss:sum"]) <= 1e-5
