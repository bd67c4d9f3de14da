"""Bad input: a clear error naming the field, and no state changed (weights, grads, moments)."""

from __future__ import annotations

import math

import pytest
import torch

from lorafleet.errors import FailedPrecondition, InvalidArgument
from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)


def ce(tokens, targets=None, weights=None) -> Datum:
    n = len(tokens)
    t = torch.tensor(targets if targets is not None else [1] * n)
    w = torch.tensor(weights if weights is not None else [1.0] * n)
    return Datum(list(tokens), {"target_tokens": t, "weights": w})


def rl(n: int, adv=None, old=None) -> Datum:
    return Datum(
        [1] * n,
        {
            "target_tokens": torch.ones(n, dtype=torch.int64),
            "logprobs": torch.tensor(old if old is not None else [-1.0] * n),
            "advantages": torch.tensor(adv if adv is not None else [1.0] * n),
        },
    )


@pytest.fixture
def trained(make_engine, h):
    """An engine with a stepped slot (moments exist) and pending gradients."""
    engine = make_engine()
    engine.bind(0, "r0", LoraSpec(rank=4, seed=1))
    engine.bind(1, "r1", LoraSpec(rank=2, seed=2, dropout=0.1))
    h.perturb(engine, 0, seed=1)
    for slot in (0, 1):
        item = ForwardBackwardItem(
            f"fb{slot}", slot, f"r{slot}", ForwardBackwardInput([ce([1, 2, 3])], "cross_entropy")
        )
        engine.forward_backward([item])
        assert engine.optim_step(f"s{slot}", slot, f"r{slot}", AdamParams(1e-3)).applied
    engine.forward_backward(
        [
            ForwardBackwardItem(
                "fb-pending", 0, "r0", ForwardBackwardInput([ce([4, 5])], "cross_entropy")
            )
        ]
    )
    return engine


BAD_ITEMS = [
    (ForwardBackwardInput([ce([1, 300])], "cross_entropy"), "data[0].tokens[1]"),
    (ForwardBackwardInput([ce([1, -1])], "cross_entropy"), "data[0].tokens[1]"),
    (
        ForwardBackwardInput([ce([1, 2], targets=[1, 256])], "cross_entropy"),
        "data[0].loss_fn_inputs.target_tokens[1]",
    ),
    (
        ForwardBackwardInput([ce([1, 2], targets=[1, 2, 3], weights=[1.0, 1, 1])], "cross_entropy"),
        "data[0].loss_fn_inputs.target_tokens",
    ),
    (
        ForwardBackwardInput([ce([1, 2], weights=[1.0])], "cross_entropy"),
        "data[0].loss_fn_inputs.weights",
    ),
    (
        ForwardBackwardInput([ce([1, 2]), ce([1, 2], weights=[1.0, math.nan])], "cross_entropy"),
        "data[1].loss_fn_inputs.weights",
    ),
    (
        ForwardBackwardInput([rl(3, adv=[1.0, math.inf, 0.0])], "ppo"),
        "data[0].loss_fn_inputs.advantages",
    ),
    (
        ForwardBackwardInput([rl(3, old=[1.0, math.nan, 0.0])], "importance_sampling"),
        "data[0].loss_fn_inputs.logprobs",
    ),
    (
        ForwardBackwardInput(
            [Datum([1, 2], {"target_tokens": torch.ones(2, dtype=torch.int64)})], "cispo"
        ),
        "data[0].loss_fn_inputs.logprobs",
    ),
    (ForwardBackwardInput([rl(3)], "stable_reinforce"), "loss_fn"),
    (ForwardBackwardInput([rl(3)], "custom"), "loss_fn"),
    (
        ForwardBackwardInput([rl(3)], "ppo", {"clip_low_threshold": math.nan}),
        "loss_fn_config.clip_low_threshold",
    ),
    (ForwardBackwardInput([rl(3)], "dro", {"beta": -1.0}), "loss_fn_config.beta"),
    (ForwardBackwardInput([], "cross_entropy"), "data"),
    (ForwardBackwardInput([ce([])], "cross_entropy"), "data[0].tokens"),
    (ForwardBackwardInput([ce([1] * 300)], "cross_entropy"), "data[0].tokens"),
    (
        ForwardBackwardInput(
            [Datum([1, 2], {"target_tokens": torch.ones(2, dtype=torch.bfloat16)})],
            "cross_entropy",
        ),
        "data[0].loss_fn_inputs.target_tokens.dtype",
    ),
    (
        ForwardBackwardInput([ce([1, 2])], "cross_entropy", group_tokens=-1),
        "group_tokens",
    ),
]


@pytest.mark.parametrize(("inp", "field"), BAD_ITEMS)
def test_bad_forward_backward_item(trained, h, inp, field) -> None:
    before = h.snapshot(trained)
    good = ForwardBackwardItem(
        "fwd", 1, "r1", ForwardBackwardInput([ce([1, 2, 3])], "cross_entropy", forward_only=True)
    )
    bad, ok = trained.forward_backward([ForwardBackwardItem("bad", 0, "r0", inp), good])
    assert isinstance(bad, InvalidArgument) and bad.field == field, bad
    assert not isinstance(ok, Exception)  # other items of the batch still run
    h.assert_same(before, h.snapshot(trained))
    if field == "loss_fn":
        assert "cross_entropy" in bad.message and "gspo" in bad.message


@pytest.mark.parametrize(
    ("slot", "reg", "error", "field"),
    [
        (3, "r3", FailedPrecondition, "slot"),
        (0, "r1", FailedPrecondition, "registration_id"),
        (9, "r0", InvalidArgument, "slot"),
    ],
)
def test_unbound_slot_or_wrong_lease(trained, h, slot, reg, error, field) -> None:
    before = h.snapshot(trained)
    (res,) = trained.forward_backward(
        [ForwardBackwardItem("x", slot, reg, ForwardBackwardInput([ce([1, 2])], "cross_entropy"))]
    )
    assert isinstance(res, error) and res.field == field
    with pytest.raises(error) as err:
        trained.optim_step("x", slot, reg, AdamParams())
    assert err.value.field == field
    h.assert_same(before, h.snapshot(trained))


@pytest.mark.parametrize(
    ("hp", "field"),
    [
        (AdamParams(learning_rate=math.nan), "adam_params.learning_rate"),
        (AdamParams(learning_rate=-1.0), "adam_params.learning_rate"),
        (AdamParams(beta1=1.0), "adam_params.beta1"),
        (AdamParams(beta2=math.inf), "adam_params.beta2"),
        (AdamParams(eps=0.0), "adam_params.eps"),
        (AdamParams(weight_decay=-0.1), "adam_params.weight_decay"),
        (AdamParams(grad_clip_norm=math.nan), "adam_params.grad_clip_norm"),
    ],
)
def test_bad_hyperparameters(trained, h, hp, field) -> None:
    before = h.snapshot(trained)
    with pytest.raises(InvalidArgument) as err:
        trained.optim_step("bad-step", 0, "r0", hp)
    assert err.value.field == field
    h.assert_same(before, h.snapshot(trained))


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        (LoraSpec(rank=17), "lora_config.rank"),
        (LoraSpec(rank=0), "lora_config.rank"),
        (LoraSpec(rank=2, dropout=1.0), "lora_config.dropout"),
        (LoraSpec(rank=2, alpha=math.nan), "lora_config.alpha"),
        (LoraSpec(rank=2, target_modules=("qproj",)), "lora_config.target_modules"),
        (LoraSpec(rank=2, exclude_modules=("nope",)), "lora_config.exclude_modules"),
        (LoraSpec(rank=2, train_attn=False, train_mlp=False), "lora_config.target_modules"),
    ],
)
def test_bad_bind(trained, h, spec, field) -> None:
    before = h.snapshot(trained)
    with pytest.raises(InvalidArgument) as err:
        trained.bind(2, "r2", spec)
    assert err.value.field == field
    with pytest.raises(FailedPrecondition):
        trained.bind(0, "someone-else", LoraSpec(rank=2))
    h.assert_same(before, h.snapshot(trained))


def test_unbind_frees_everything(trained) -> None:
    trained.unbind(0, "r0")
    assert trained.slots.bindings[0] is None
    assert all(0 not in w.adapters for w in trained.wrappers.values())
    trained.unbind(0, "r0")  # idempotent
    info = trained.bind(0, "new", LoraSpec(rank=4, seed=1))
    assert info.optim_steps == 0 and not info.has_pending_gradients
