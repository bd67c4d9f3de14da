"""One forward_backward pass: every plan's rows through the shared base at once.

Rows are sorted by slot (and slots by rank), each rank of a trainer group computes its
contiguous, token-balanced share (`RowShare`), the LoRA wrappers read the routing from the
`Router`, truncated-BPTT windows run after the rows, and each slot's gradients are summed
over ranks and joined to what its earlier calls accumulated. The engine validates the
items and records results; this module only computes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from lorafleet_trainer import bptt, metrics
from lorafleet_trainer.domain import ForwardBackwardOutput
from lorafleet_trainer.dropout import row_key
from lorafleet_trainer.lora import Router, RowGroup
from lorafleet_trainer.losses import LossConfig, PreparedDatum, elementwise_output, per_token_loss
from lorafleet_trainer.rowshare import RowShare
from lorafleet_trainer.slots import Binding


@dataclass
class Plan:
    """One validated forward_backward item, ready to run."""

    index: int
    binding: Binding
    slot: int
    cfg: LossConfig
    data: list[PreparedDatum]
    backward: bool


def run_pass(
    model: nn.Module, router: Router, dev: torch.device, share: RowShare, plans: list[Plan]
) -> list[ForwardBackwardOutput]:
    """Run every plan's rows through the base in one pass (this rank's share of them), add
    each slot's gradients to what it accumulated, and return per-plan outputs in order."""
    rows: list[tuple[Plan, PreparedDatum]] = []
    windows: list[tuple[Plan, PreparedDatum, RowGroup]] = []  # truncated-BPTT rows
    group_rows: dict[tuple[int, bool], list[int]] = {}
    row_keys: list[int | None] = []  # each row's dropout mask key
    ordinals: dict[int, int] = {}
    for plan in plans:
        spec = plan.binding.spec
        dropout = plan.backward and spec.dropout > 0
        for d in plan.data:
            key = None
            if dropout:
                ordinal = ordinals.get(plan.slot, plan.binding.pending_datums)
                ordinals[plan.slot] = ordinal + 1
                key = row_key(spec.seed, plan.binding.optimizer.steps, ordinal)
            if d.context or d.window:  # runs alone after its detached context (bptt.py)
                rate = spec.dropout if dropout else 0.0
                keys = None if key is None else [key]
                windows.append((plan, d, RowGroup(plan.slot, 1, spec.rank, spec.scale, rate, keys)))
                continue
            group_rows.setdefault((plan.slot, dropout), []).append(len(rows))
            rows.append((plan, d))
            row_keys.append(key)
    # Sort rows by group, and groups by rank (largest first, stable), so every group is a
    # contiguous split of the batch and every rank class a contiguous run of groups; a
    # rank's share is a contiguous range of this order, so the same holds for its rows.
    specs = {plan.slot: plan.binding.spec for plan in plans}
    group_rows = dict(sorted(group_rows.items(), key=lambda kv: -specs[kv[0][0]].rank))
    order = [r for members in group_rows.values() for r in members]
    row_group = [g for g, members in group_rows.items() for _ in members]
    rows = [rows[r] for r in order]
    row_keys = [row_keys[r] for r in order]
    first, last = share.share([len(d.tokens) for _, d in rows], row_group)
    groups: list[RowGroup] = []
    for r in range(first, last):
        (slot, dropout), key = row_group[r], row_keys[r]
        if groups and r > first and row_group[r - 1] == row_group[r]:
            groups[-1].size += 1
            if key is not None:
                assert groups[-1].dropout_keys is not None
                groups[-1].dropout_keys.append(key)
            continue
        spec = specs[slot]
        rate = spec.dropout if dropout else 0.0
        groups.append(
            RowGroup(slot, 1, spec.rank, spec.scale, rate, None if key is None else [key])
        )
    # id(datum) -> (its summed loss, target logprobs, elementwise_loss)
    scored: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    recomputed: dict[int, int] = {}  # id(plan) -> context tokens its windows computed

    def score(plan: Plan, d: PreparedDatum, logp: torch.Tensor) -> None:
        n = len(d.tokens)
        targets = d.target_tokens.to(dev)
        lp_t = logp.gather(-1, targets.view(n, -1)).view(targets.shape)
        terms = per_token_loss(plan.cfg, lp_t, _to_device(d, dev))
        scored[id(d)] = (terms.sum(), lp_t.detach(), elementwise_output(terms))

    need_grad = any(p.backward for p in plans)
    bindings = {p.slot: p.binding for p in plans}
    summed = {p.slot for p in plans if p.backward}
    # This call's gradients alone: they are summed over ranks before joining what earlier
    # calls accumulated, and slots that only ran forward keep theirs untouched.
    earlier = {slot: [p.grad for p in b.optimizer.params] for slot, b in bindings.items()}
    for b in bindings.values():  # (the optimizers keep their float64 sums meanwhile)
        for param in b.optimizer.params:
            param.grad = None
    # Each call's gradients join the earlier ones in float64 (_join_gradients), and a group
    # sums them over ranks in float64 first: what each lost in its rounding is collected.
    router.residuals = {}
    local_tokens = sum(len(d.tokens) for _, d, _ in windows)
    try:
        with torch.set_grad_enabled(need_grad):
            zero_term = None
            if rows:
                local = rows[first:last]
                if not local:
                    # Fewer rows than ranks: a one-token row through no slot keeps this
                    # rank's collectives (FSDP's all-gathers) in step with the others.
                    groups = [RowGroup(-1, 1, 1, 0.0)]
                width = max((len(d.tokens) for _, d in local), default=1)
                ids = torch.zeros(max(len(local), 1), width, dtype=torch.int64)
                for r, (_, d) in enumerate(local):
                    ids[r, : len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.int64)
                local_tokens += sum(len(d.tokens) for _, d in local) or 1
                # Right padding needs no attention mask: causal attention never looks ahead.
                with router.route(groups, dev):
                    logits = model(input_ids=ids.to(dev), use_cache=False).logits
                if share.world > 1 and need_grad:
                    zero_term = logits.sum() * 0.0  # every rank runs the same backward
                logp_all = torch.log_softmax(logits.float(), dim=-1)
                for r, (plan, d) in enumerate(local):
                    score(plan, d, logp_all[r, : len(d.tokens)])
            for plan, d, group in windows:
                w = bptt.window_logits(
                    model,
                    router,
                    group,
                    d.context,
                    d.tokens,
                    dev,
                    plan.binding.carried,
                )
                plan.binding.carried = w.carried
                recomputed[id(plan)] = recomputed.get(id(plan), 0) + w.context_tokens
                score(plan, d, torch.log_softmax(w.logits.float(), dim=-1))
            # grad_scale is exactly 1 unless the call asked for token-mean normalisation
            # (group_tokens: the caller's whole-batch count, so the same on every rank).
            # Every rank computes every window (a window carries its slot's keys/values to
            # the next, so windows run in order); only rank 0's count in the summed gradients.
            zeroed = {id(d) for _, d, _ in windows} if share.rank else set()
            backward_terms = [
                torch.stack(mine).sum() * p.cfg.grad_scale
                for p in plans
                if p.backward
                and (
                    mine := [
                        scored[id(d)][0] * 0.0 if id(d) in zeroed else scored[id(d)][0]
                        for d in p.data
                        if id(d) in scored
                    ]
                )
            ]
            if zero_term is not None:
                backward_terms.append(zero_term)
            if backward_terms:
                torch.stack(backward_terms).sum().backward()
    except BaseException:  # forward_backward clears the trained slots' gradients
        router.residuals = None
        for slot, b in bindings.items():
            if slot not in summed:
                for param, old in zip(b.optimizer.params, earlier[slot], strict=True):
                    param.grad = old
        raise
    _join_gradients(share, router, bindings, summed, earlier)
    metrics.FORWARD_TOKENS.labels(kind="datum").inc(local_tokens)
    if share.world > 1:  # every rank's rows, on the CPU (as the outputs are)
        for key, (summed_loss, lp, el) in scored.items():
            scored[key] = (summed_loss.detach().cpu(), lp.cpu(), el.cpu())
        if rows:
            computed = {r: scored[id(rows[r][1])] for r in range(first, last)}
            for theirs in share.gather(computed):
                for r, result in theirs.items():
                    scored[id(rows[r][1])] = result
    outputs = []
    for p in plans:
        loss, logprobs, elementwise = zip(*(scored[id(d)] for d in p.data), strict=True)
        out_metrics = {"loss:sum": float(torch.stack(loss).sum().detach())}
        own = sum(len(d.tokens) for d in p.data)
        if any(d.context or d.window for d in p.data):  # a document job's: what it cost
            context = recomputed.get(id(p), 0)
            metrics.FORWARD_TOKENS.labels(kind="context").inc(context)
            out_metrics["forward_tokens:sum"] = float(own + context)
            out_metrics["context_tokens_computed:sum"] = float(context)
        outputs.append(
            ForwardBackwardOutput(
                logprobs=[t.float().cpu() for t in logprobs],
                metrics=out_metrics,
                elementwise_loss=[t.float().cpu() for t in elementwise],
            )
        )
    return outputs


def _join_gradients(
    share: RowShare,
    router: Router,
    bindings: dict[int, Binding],
    summed: set[int],
    earlier: dict[int, list[torch.Tensor | None]],
) -> None:
    """Sum this pass's gradients over ranks (one all-reduce of every trained slot's LoRA
    gradients, replicated on every rank) and add them to the earlier accumulation; slots
    that only ran forward get their earlier gradients back, untouched.

    This pass's gradient of each tensor is taken in float64, with what its rounding to
    float32 lost (`Router.residuals`): the all-reduce sums those, so a slot whose rows were
    split between ranks gets the same sum over its rows as in one process (lora.py), and
    the slot's optimizer adds it to the float64 sum of its earlier calls (optim.py), so
    calls accumulate as one call would, bit for bit."""
    residuals, router.residuals = router.residuals or {}, None
    trained = [p for slot in sorted(summed) for p in bindings[slot].optimizer.params]

    def exact(p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:
            return p.new_zeros(p.shape, dtype=torch.float64)
        g = p.grad.to(torch.float64, copy=True)
        if id(p) in residuals:
            g += residuals[id(p)]
        return g

    calls: dict[int, torch.Tensor] = {}  # id(parameter) -> this pass's float64 gradient
    if share.world > 1 and trained:
        flat = torch.cat([exact(p).reshape(-1) for p in trained])
        share.sum_gradients(flat)
        for p, g in zip(trained, flat.split([p.numel() for p in trained]), strict=True):
            calls[id(p)] = g.view_as(p)
    else:
        calls = {id(p): exact(p) for p in trained if p.grad is not None}
    for slot, b in bindings.items():
        for i, (p, old) in enumerate(zip(b.optimizer.params, earlier[slot], strict=True)):
            p.grad = old
            if slot in summed and id(p) in calls:
                b.optimizer.accumulate(i, calls[id(p)])


def _to_device(d: PreparedDatum, dev: torch.device) -> PreparedDatum:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(dev)

    return dataclasses.replace(
        d,
        weights=move(d.weights),
        sampling_logprobs=move(d.sampling_logprobs),
        advantages=move(d.advantages),
        ratio_mask=move(d.ratio_mask),
    )
