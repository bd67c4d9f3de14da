"""Token-mean normalisation over an accumulation group (issue 13, juno's accumulation).

A managed job accumulates a group of chunks, divides the summed gradient by the group's
total number of prediction tokens, then clips globally. The engine does it with
`ForwardBackwardInput.group_tokens`; the reference is PEFT with the same loss summed over
every chunk and divided by the token count, clipped by torch and stepped by torch's AdamW.
"""

from __future__ import annotations

import pytest
import torch

from lorafleet.errors import InvalidArgument
from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
)

TOL = 1e-5
VOCAB = 256
SPEC = LoraSpec(rank=4, alpha=8, seed=41, train_attn=True, train_mlp=True)


def completion_datum(gen: torch.Generator, prompt: int, answer: int) -> Datum:
    """Completion-only loss: weight 1 on the answer's targets, 0 on the prompt's."""
    n = prompt + answer
    weights = torch.cat([torch.zeros(prompt), torch.ones(answer)])
    return Datum(
        torch.randint(0, VOCAB, (n,), generator=gen).tolist(),
        {"target_tokens": torch.randint(0, VOCAB, (n,), generator=gen), "weights": weights},
    )


def prediction_tokens(chunks: list[list[Datum]]) -> int:
    return sum(int((d.loss_fn_inputs["weights"] != 0).sum()) for c in chunks for d in c)


def test_token_mean_group_then_clip_and_step_match_peft(make_engine, h) -> None:
    engine = make_engine()
    engine.bind(0, "r0", SPEC)
    h.perturb(engine, 0, seed=7)
    gen = torch.Generator().manual_seed(11)
    chunks = [
        [completion_datum(gen, 5, 3), completion_datum(gen, 2, 6)],
        [completion_datum(gen, 7, 2)],
        [completion_datum(gen, 3, 4), completion_datum(gen, 4, 1), completion_datum(gen, 1, 5)],
    ]
    total = prediction_tokens(chunks)

    pm = h.peft_model(engine, 0)
    ref_sum = torch.zeros(())
    for chunk in chunks:
        for d in chunk:
            logits = pm(input_ids=torch.tensor([d.tokens])).logits[0].float()
            lp = torch.log_softmax(logits, -1).gather(
                -1, d.loss_fn_inputs["target_tokens"].view(-1, 1)
            )[:, 0]
            ref_sum = ref_sum + -(lp * d.loss_fn_inputs["weights"]).sum()
    (ref_sum / total).backward()
    ref_sum = ref_sum.detach()
    ref_grads = h.peft_grads(pm)

    reported = 0.0
    for i, chunk in enumerate(chunks):
        inp = ForwardBackwardInput(chunk, "cross_entropy", group_tokens=total)
        (out,) = engine.forward_backward([ForwardBackwardItem(f"fb{i}", 0, "r0", inp)])
        reported += out.metrics["loss:sum"]  # unscaled: the job divides the group's sum
    assert abs(reported / total - ref_sum.item() / total) <= TOL
    grads = h.slot_grads(engine, 0)
    assert grads.keys() == ref_grads.keys()
    for key, g in grads.items():
        assert (g - ref_grads[key]).abs().max().item() <= TOL * max(1.0, ref_grads[key].abs().max())
    assert any(g.abs().max() > 0 for g in grads.values())

    # Then one global clip and AdamW step, as juno does after the group.
    hp = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-2, grad_clip_norm=0.01)
    result = engine.optim_step("step", 0, "r0", hp)
    assert result.applied and result.metrics["grad_norm"] > hp.grad_clip_norm  # clipping active
    params = [p for n, p in pm.named_parameters() if "lora_" in n]
    torch.nn.utils.clip_grad_norm_(params, hp.grad_clip_norm)
    torch.optim.AdamW(
        params, lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=0.0
    ).step()
    ref_weights = {n.replace(".default", ""): p.detach() for n, p in pm.named_parameters()}
    for key, w in h.adapter_tensors(engine, 0).items():
        assert (w - ref_weights[key]).abs().max().item() <= TOL, key


def test_group_tokens_zero_is_the_plain_sum(make_engine, h) -> None:
    """Without group_tokens the gradient is Tinker's sum, bit for bit the same as before."""
    gen = torch.Generator().manual_seed(12)
    data = [completion_datum(gen, 3, 4), completion_datum(gen, 2, 2)]
    grads = []
    for group_tokens in (0, 1):
        engine = make_engine()
        engine.bind(0, "r0", SPEC)
        h.perturb(engine, 0, seed=7)
        inp = ForwardBackwardInput(data, "cross_entropy", group_tokens=group_tokens)
        engine.forward_backward([ForwardBackwardItem("fb", 0, "r0", inp)])
        grads.append(h.slot_grads(engine, 0))
    assert all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])


@pytest.mark.parametrize("group_tokens", [-1, 2.5, True])
def test_bad_group_tokens_is_refused_and_changes_nothing(make_engine, h, group_tokens) -> None:
    engine = make_engine()
    engine.bind(0, "r0", SPEC)
    h.perturb(engine, 0, seed=7)
    before = h.snapshot(engine)
    gen = torch.Generator().manual_seed(13)
    inp = ForwardBackwardInput(
        [completion_datum(gen, 2, 2)], "cross_entropy", group_tokens=group_tokens
    )
    (res,) = engine.forward_backward([ForwardBackwardItem("fb", 0, "r0", inp)])
    assert isinstance(res, InvalidArgument) and res.field == "group_tokens", res
    h.assert_same(before, h.snapshot(engine))
