"""Truncated-BPTT windows (issue 13, juno's document training) against a PEFT reference.

A window is a datum whose `context` is its document's earlier windows. The reference is
written differently from the engine: PEFT runs the whole prefix (context + window) in one
pass, with forward hooks that detach every k_proj/v_proj output at the context positions.
Attention is the only way positions mix, so that is exactly "the window attends to the
context's keys/values, and no gradient flows into them".
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lorafleet.errors import InvalidArgument
from lorafleet.testing import fb_output, payload_bytes
from lorafleet.v1 import common_pb2, trainer_pb2
from lorafleet_trainer import convert
from lorafleet_trainer.domain import Datum, ForwardBackwardInput, ForwardBackwardItem, LoraSpec
from lorafleet_trainer.servicer import TrainerServicer

TOL = 1e-5
VOCAB = 256
WINDOW = 8
SPECS = [
    LoraSpec(rank=4, alpha=8, seed=51, train_attn=True, train_mlp=True),
    LoraSpec(rank=2, seed=52, target_modules=("k_proj", "v_proj", "up_proj")),
]


def windows(doc: list[int], gen: torch.Generator) -> list[Datum]:
    """One datum per window: next-token targets, random (also negative) weights."""
    out = []
    for start in range(0, len(doc) - 1, WINDOW):
        tokens = doc[start : start + WINDOW]
        targets = torch.tensor(doc[start + 1 : start + 1 + len(tokens)], dtype=torch.int64)
        tokens = tokens[: len(targets)]
        inputs = {"target_tokens": targets, "weights": torch.randn(len(tokens), generator=gen)}
        out.append(Datum(tokens, inputs, context=doc[:start], window=True))
    return out


def reference(h, engine, slot: int, data: list[Datum], detach: bool = True):
    """Per-window logprobs and the summed gradient, computed over the whole prefix."""
    pm = h.peft_model(engine, slot)
    cut = {"at": 0}

    def detach_context(_module, _inputs, out):
        c = cut["at"]
        return torch.cat([out[:, :c].detach(), out[:, c:]], dim=1) if detach and c else out

    hooks = [
        m.register_forward_hook(detach_context)
        for name, m in pm.named_modules()
        if name.endswith(("k_proj", "v_proj"))
    ]
    logprobs = []
    try:
        for d in data:
            c, n = len(d.context), len(d.tokens)
            cut["at"] = c
            logits = pm(input_ids=torch.tensor([d.context + d.tokens])).logits[0, c:].float()
            t = d.loss_fn_inputs["target_tokens"]
            lp = torch.log_softmax(logits, -1).gather(-1, t.view(n, 1))[:, 0]
            (-(lp * d.loss_fn_inputs["weights"])).sum().backward()
            logprobs.append(lp.detach())
    finally:
        for hook in hooks:
            hook.remove()
    return logprobs, h.peft_grads(pm)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_windows_with_detached_context_match_peft(make_engine, h) -> None:
    """Windows of two documents, mixed with plain datums and another slot's batch."""
    engine = make_engine()
    for slot, spec in enumerate(SPECS):
        engine.bind(slot, f"r{slot}", spec)
        h.perturb(engine, slot, seed=500 + slot)
    gen = torch.Generator().manual_seed(3)
    doc_a = torch.randint(0, VOCAB, (27,), generator=gen).tolist()
    doc_b = torch.randint(0, VOCAB, (19,), generator=gen).tolist()
    wa, wb = windows(doc_a, gen), windows(doc_b, gen)
    assert [len(d.context) for d in wa] == [0, 8, 16, 24] and len(wb) == 3
    # Plain datums (no context) between windows: outputs must keep the datums' order.
    data = {0: [wa[2], wb[0], wa[0], wa[3], wb[2], wa[1], wb[1]], 1: [wb[2], wa[1], wb[0]]}
    items = [
        ForwardBackwardItem(f"op{s}", s, f"r{s}", ForwardBackwardInput(data[s], "cross_entropy"))
        for s in (1, 0)
    ]
    results = engine.forward_backward(items)
    for item, out in zip(items, results, strict=True):
        s = item.slot
        ref_lp, ref_grads = reference(h, engine, s, data[s])
        for got, want in zip(out.logprobs, ref_lp, strict=True):
            assert got.shape == want.shape and (got - want).abs().max().item() <= TOL
        grads = h.slot_grads(engine, s)
        assert max_diff(grads, ref_grads) <= TOL
        # The reference discriminates: letting gradients into the context changes them.
        _, full = reference(h, engine, s, data[s], detach=False)
        assert max_diff(full, ref_grads) > 1e-3


def test_window_context_bad_input_changes_nothing(make_engine, h) -> None:
    engine = make_engine()
    engine.bind(0, "r0", SPECS[0])
    h.perturb(engine, 0, seed=1)
    before = h.snapshot(engine)
    t = {"target_tokens": torch.tensor([1, 2]), "weights": torch.ones(2)}
    for datum, field in (
        (Datum([1, 2], t, context=[3, VOCAB]), "data[0].context[1]"),
        (Datum([1, 2], t, context=[3] * 255), "data[0].tokens"),  # 257 > 256 positions
    ):
        inp = ForwardBackwardInput([datum], "cross_entropy")
        (res,) = engine.forward_backward([ForwardBackwardItem("fb", 0, "r0", inp)])
        assert isinstance(res, InvalidArgument) and res.field == field, res
    h.assert_same(before, h.snapshot(engine))


def test_window_dropout_is_seeded(make_engine, h) -> None:
    """A dropout slot's window gets its row's hashed mask: same call, same gradient; and
    the mask is really applied (the gradient differs from the same slot without dropout)."""
    gen = torch.Generator().manual_seed(8)
    doc = torch.randint(0, VOCAB, (20,), generator=gen).tolist()
    window = windows(doc, gen)[1]
    spec = LoraSpec(rank=4, seed=61, dropout=0.3, train_attn=True, train_mlp=True)

    def grads(spec: LoraSpec) -> dict[str, torch.Tensor]:
        engine = make_engine()
        engine.bind(0, "r0", spec)
        h.perturb(engine, 0, seed=9)
        inp = ForwardBackwardInput([window], "cross_entropy")
        engine.forward_backward([ForwardBackwardItem("fb", 0, "r0", inp)])
        return h.slot_grads(engine, 0)

    first, again = grads(spec), grads(spec)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert max_diff(first, grads(LoraSpec(rank=4, seed=61, train_attn=True, train_mlp=True))) > 1e-4


async def test_context_and_group_tokens_travel_over_grpc(make_engine, h) -> None:
    """The proto fields managed jobs set reach the engine: the servicer's result and gradient
    are bit-identical to the same call made on the engine directly. A document's first and
    second windows: without `window` the first would not be kept, and the second would
    compute 8 context tokens more (a metric in the result)."""
    gen = torch.Generator().manual_seed(10)
    document = windows(torch.randint(0, VOCAB, (20,), generator=gen).tolist(), gen)[:2]
    engines = []
    for _ in range(2):
        engine = make_engine()
        engine.bind(0, "r0", SPECS[0])
        h.perturb(engine, 0, seed=4)
        engines.append(engine)
    inp = ForwardBackwardInput(document, "cross_entropy", group_tokens=5)
    (direct,) = engines[0].forward_backward([ForwardBackwardItem("fb", 0, "r0", inp)])
    assert direct.metrics["context_tokens_computed:sum"] == 0

    servicer = TrainerServicer(engines[1], "replica-test")
    protos = [
        common_pb2.Datum(
            tokens=w.tokens,
            loss_fn_inputs={k: convert.tensor_to_proto(v) for k, v in w.loss_fn_inputs.items()},
            context=w.context,
            window=True,
        )
        for w in document
    ]
    request = trainer_pb2.ForwardBackwardRequest(
        items=[
            trainer_pb2.ForwardBackwardItem(
                operation_id="fb",
                slot=0,
                registration_id="r0",
                payload=payload_bytes(
                    common_pb2.ForwardBackwardInput(
                        data=protos, loss_fn="cross_entropy", group_tokens=5
                    )
                ),
            )
        ]
    )
    try:
        response = await servicer.ForwardBackward(request, None)
    finally:
        servicer.executor.shutdown()
    (result,) = response.results
    assert fb_output(result) == convert.fb_output_to_proto(direct)
    served, reference = h.slot_grads(engines[1], 0), h.slot_grads(engines[0], 0)
    assert all(torch.equal(served[k], reference[k]) for k in served)


def one_by_one(engine, slot: int, data: list[Datum], first: int = 0, group: int = 0) -> list:
    """Each window as its own call, as a document job sends them (token-mean over `group`
    tokens when set); the results."""
    out = []
    for i, d in enumerate(data, first):
        inp = ForwardBackwardInput([d], "cross_entropy", group_tokens=group)
        (res,) = engine.forward_backward([ForwardBackwardItem(f"w{i}", slot, f"r{slot}", inp)])
        assert not isinstance(res, Exception), res
        out.append(res)
    return out


def test_windows_carry_keys_values_so_each_token_runs_once(make_engine, h) -> None:
    """A document filling the model's 256 positions, one call per window, token-mean over
    the document (a job's accumulation group): the carried keys/values are reused (no
    context token computed again but the first window's), and the result equals PEFT over
    the whole prefix. Dropping the carried cache before each call recomputes the context
    (quadratic) and gives the same numbers."""
    gen = torch.Generator().manual_seed(21)
    doc = torch.randint(0, VOCAB, (256,), generator=gen).tolist()
    data = windows(doc, gen)
    engine = make_engine()
    engine.bind(0, "r0", SPECS[0])
    h.perturb(engine, 0, seed=22)
    results = one_by_one(engine, 0, data, group=len(doc) - 1)
    assert all(r.metrics["context_tokens_computed:sum"] == 0 for r in results)
    assert sum(r.metrics["forward_tokens:sum"] for r in results) == len(doc) - 1
    ref_lp, ref_grads = reference(h, engine, 0, data)
    for got, want in zip(results, ref_lp, strict=True):
        assert (got.logprobs[0] - want).abs().max().item() <= TOL
    mean = {k: g / (len(doc) - 1) for k, g in ref_grads.items()}
    assert max_diff(h.slot_grads(engine, 0), mean) <= TOL

    again = make_engine()
    again.bind(0, "r0", SPECS[0])
    h.perturb(again, 0, seed=22)
    fresh = []
    for i, d in enumerate(data):
        again.slots.bindings[0].carried = None  # as after a restart: nothing to carry
        fresh += one_by_one(again, 0, [d], first=i)
    assert sum(r.metrics["context_tokens_computed:sum"] for r in fresh) == sum(
        len(d.context) for d in data
    )
    for got, want in zip(fresh, results, strict=True):
        assert (got.logprobs[0] - want.logprobs[0]).abs().max().item() <= TOL


def test_a_skipped_window_runs_only_its_own_tokens(make_engine, h) -> None:
    """A window whose context extends the carried tokens (the window between was left out
    by max_train_tokens) computes just the tokens in between; a context that does not start
    with the carried ones (another document) is computed whole."""
    gen = torch.Generator().manual_seed(23)
    doc = torch.randint(0, VOCAB, (40,), generator=gen).tolist()
    other = torch.randint(0, VOCAB, (30,), generator=gen).tolist()
    wd, wo = windows(doc, gen), windows(other, gen)
    data = [wd[0], wd[2], wo[3], wd[3]]
    engine = make_engine()
    engine.bind(0, "r0", SPECS[1])
    h.perturb(engine, 0, seed=24)
    results = one_by_one(engine, 0, data)
    assert [r.metrics["context_tokens_computed:sum"] for r in results] == [0, 8, 24, 24]
    data = [wd[1], wd[3]]
    results += one_by_one(engine, 0, data, first=len(results))
    assert [r.metrics["context_tokens_computed:sum"] for r in results[4:]] == [8, 8]
    data = [wd[0], wd[2], wo[3], wd[3], wd[1], wd[3]]
    ref_lp, ref_grads = reference(h, engine, 0, data)
    for got, want in zip(results, ref_lp, strict=True):
        assert (got.logprobs[0] - want).abs().max().item() <= TOL
    assert max_diff(h.slot_grads(engine, 0), ref_grads) <= TOL


def test_carried_keys_values_keep_the_weights_they_were_computed_with(make_engine, h) -> None:
    """juno's semantics: an optimizer update between two windows of a document leaves the
    carried keys/values as the earlier window computed them. Reference: PEFT with the old
    weights computes the first window's cache, PEFT with the new weights reads the second
    window after it."""
    from lorafleet_trainer.domain import AdamParams

    gen = torch.Generator().manual_seed(25)
    doc = torch.randint(0, VOCAB, (25,), generator=gen).tolist()
    first, second, third = windows(doc, gen)
    engine = make_engine()
    engine.bind(0, "r0", SPECS[0])
    h.perturb(engine, 0, seed=26)
    old = h.peft_model(engine, 0)
    one_by_one(engine, 0, [first, second])
    assert engine.slots.bindings[0].carried.tokens == tuple(doc[:16])
    step = engine.optim_step("step", 0, "r0", AdamParams(learning_rate=0.05))
    assert step.applied
    (got,) = one_by_one(engine, 0, [third], first=2)
    assert got.metrics["context_tokens_computed:sum"] == 0
    second = third

    new = h.peft_model(engine, 0)
    t = second.loss_fn_inputs["target_tokens"]
    with torch.no_grad():
        cache = old(input_ids=torch.tensor([second.context]), use_cache=True).cache
        logits = new(input_ids=torch.tensor([second.tokens]), cache=cache).logits[0]
        fresh = new(input_ids=torch.tensor([second.context + second.tokens])).logits[0, 16:]

    def lp(x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float(), -1).gather(-1, t.view(-1, 1))[:, 0]

    assert (got.logprobs[0] - lp(logits)).abs().max().item() <= TOL
    assert (got.logprobs[0] - lp(fresh)).abs().max().item() > 1e-4  # the choice shows
    # A job saves at a pass boundary or its end: the carried cache is freed there.
    assert engine.optim_step("step2", 0, "r0", AdamParams(learning_rate=0.05)).applied
    engine.save_state("save", 0, "r0", "end", include_optimizer=False)
    assert engine.slots.bindings[0].carried is None


def test_a_document_past_the_positions_trains_at_linear_cost_equal_to_the_reference(
    make_engine, h
) -> None:
    """Issue 23's long document at the test model's scale: 4.7x its 256 positions in
    32-token windows, built by the managed jobs' own window rule (a context that would not
    fit shifts to keep positions / 16 tokens), one call per window with token-mean over the
    document. Each token's forward runs once but for the shifts' kept tokens (<= 1.1 per
    document token, counted by the engine), and every window's logprobs and the gradient
    equal a PEFT pass over each window's whole context computed afresh, within 1e-5."""
    units = pytest.importorskip("lorafleet_controller.jobs.units")
    positions, chunk = 256, 32
    engine = make_engine()
    assert engine.max_length == positions
    gen = torch.Generator().manual_seed(27)
    doc = torch.randint(0, VOCAB, (1200,), generator=gen).tolist()
    data = [
        Datum(
            list(c.tokens),
            {
                "target_tokens": torch.tensor(c.targets, dtype=torch.int64),
                "weights": torch.randn(len(c.tokens), generator=gen),
            },
            context=list(c.context),
            window=True,
        )
        for c in units.windows(doc, chunk, positions)
    ]
    assert max(len(d.context) + len(d.tokens) for d in data) <= positions
    shifts = sum(1 for a, b in itertools.pairwise(data) if len(b.context) < len(a.context))
    assert shifts >= 4, shifts
    engine.bind(0, "r0", SPECS[0])
    h.perturb(engine, 0, seed=28)
    results = one_by_one(engine, 0, data, group=len(doc) - 1)
    # forward_tokens counts every token the model computed: the window's and the context's
    # it could not take from the carried keys/values (a shift's kept tokens).
    recomputed = sum(r.metrics["context_tokens_computed:sum"] for r in results)
    computed = sum(r.metrics["forward_tokens:sum"] for r in results)
    assert computed == len(doc) - 1 + recomputed
    assert recomputed == 16 * shifts  # positions / 16 per shift, nothing else again
    assert computed / len(doc) <= 1.1, computed
    ref_lp, ref_grads = reference(h, engine, 0, data)
    for got, want in zip(results, ref_lp, strict=True):
        assert (got.logprobs[0] - want).abs().max().item() <= TOL
    mean = {k: g / (len(doc) - 1) for k, g in ref_grads.items()}
    assert max_diff(h.slot_grads(engine, 0), mean) <= TOL
