"""TrainerEngine: one base model, N fixed LoRA slots, exact per-slot training.

Synchronous and single-threaded by design (torch is not re-entrant here): the servicer
runs every call on one worker thread, which also makes each slot run one op at a time.
Every mutating call validates everything first and only then changes state, and each
carries an operation id: a repeated id returns the first result instead of applying twice.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from lorafleet import contract, names, quantize
from lorafleet.contract import LOSS_NAMES, OPTIMIZERS
from lorafleet.errors import FailedPrecondition, Internal, InvalidArgument, LorafleetError
from lorafleet.validate_msgs import Limits
from lorafleet_trainer import bptt, checkpoint, metrics
from lorafleet_trainer.domain import (
    AdamParams,
    ForwardBackwardItem,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepResult,
    SlotInfo,
    StateRef,
)
from lorafleet_trainer.dropout import row_key
from lorafleet_trainer.lora import LoraWeights, Router, RowGroup
from lorafleet_trainer.losses import (
    LossConfig,
    PreparedDatum,
    elementwise_output,
    per_token_loss,
    prepare_input,
)
from lorafleet_trainer.optim import SlotOptimizer, validate_adam
from lorafleet_trainer.quantized import quantize_base
from lorafleet_trainer.rowshare import RowShare, Single
from lorafleet_trainer.sites import wrap_model
from lorafleet_trainer.slots import RESULT_UNKNOWN, Binding, OpLog, SlotTable
from lorafleet_trainer.targets import peft_prefixes, peft_targets, resolve_targets

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_R = TypeVar("_R")


@dataclass
class _Plan:
    """One validated forward_backward item, ready to run."""

    index: int
    binding: Binding
    slot: int
    cfg: LossConfig
    data: list[PreparedDatum]
    backward: bool


class TrainerEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        base_model: str,
        num_slots: int,
        max_rank: int,
        storage_root: Path,
        max_applied_ops: int = 1024,
        quantization: str = quantize.NONE,
    ) -> None:
        self.model = model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.base_model = base_model
        self.max_rank = max_rank
        self.storage_root = Path(storage_root)
        self.max_applied_ops = max_applied_ops
        self.router = Router()
        self.wrappers, self.sites = wrap_model(model, self.router)
        # After wrapping: the wrappers' base Linears are swapped, their LoRA stays float32.
        quantize_base(model, quantization)
        self.quantization = quantization
        self.slots = SlotTable(num_slots)
        config = model.config
        self.vocab_size = int(config.vocab_size)
        self.max_length = int(getattr(config, "max_position_embeddings", 0) or 1 << 20)
        # What the contract's validator checks every forward_backward input against.
        self.limits = Limits(self.vocab_size, self.max_length)
        self.arch = str(getattr(config, "model_type", ""))
        self.device = next(model.parameters()).device
        self.incarnation = uuid.uuid4().hex
        # Which rows this process computes and how it combines them (a group sets its own).
        self.share: RowShare = Single()
        self._update_slot_gauge()

    @classmethod
    def from_pretrained(
        cls,
        path: Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        base_model: str = "",
        **kwargs: Any,
    ) -> TrainerEngine:
        """Load the base causal LM: fp32 on CPU, bf16 on GPU unless `dtype` says otherwise.

        `base_model` is the name the fleet knows it by (default: the folder's name)."""
        from transformers import AutoModelForCausalLM

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if dtype == "auto":
            dtype = "bfloat16" if device == "cuda" else "float32"
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
        # Moved through an nn.Module reference: transformers wraps PreTrainedModel.to with
        # functools.wraps, which mypy cannot bind; the call still runs PreTrainedModel.to.
        module: nn.Module = model
        module.to(device)
        name = base_model or Path(path).resolve().name
        return cls(model, base_model=name, **kwargs)

    # ------------------------------------------------------------------ slots
    def info(self) -> dict[str, Any]:
        return {
            "base_model": self.base_model,
            "num_slots": len(self.slots),
            "max_rank": self.max_rank,
            "loss_fns": list(LOSS_NAMES),
            "optimizers": list(OPTIMIZERS),
            "vocab_size": self.vocab_size,
            "max_context_length": self.max_length,
            "incarnation": self.incarnation,
            "arch": self.arch,
            "quantization": self.quantization,
        }

    def list_slots(self) -> list[SlotInfo]:
        return [self.slots.info(i) for i in range(len(self.slots))]

    def _validate_spec(self, spec: LoraSpec) -> tuple[str, ...]:
        contract.check_lora_config(spec, self.max_rank)
        return resolve_targets(spec, self.sites)

    def bind(self, slot: int, registration_id: str, spec: LoraSpec) -> SlotInfo:
        """Fresh seeded weights, no optimizer state. Binding the same again is a no-op."""
        self.slots.check_index(slot)
        if not registration_id:
            raise InvalidArgument("must not be empty", field="registration_id")
        targets = self._validate_spec(spec)
        current = self.slots.bindings[slot]
        if current is not None:
            if current.registration_id != registration_id:
                raise FailedPrecondition(
                    f"slot {slot} is bound to another registration",
                    field="slot",
                    reason="SLOT_BUSY",
                )
            if current.spec != spec:
                raise FailedPrecondition(
                    "the slot is already bound to this registration with another LoRA config",
                    field="lora_config",
                    reason="CONFIG_MISMATCH",
                )
            return self.slots.info(slot)
        a: dict[str, nn.Parameter] = {}
        b: dict[str, nn.Parameter] = {}
        for name in targets:
            w = self.wrappers[name]
            a0, b0 = w.init_weights(spec.seed, name, spec.rank, spec.share_experts, self.device)
            a[name], b[name] = nn.Parameter(a0), nn.Parameter(b0)
        for name in targets:
            self.wrappers[name].adapters[slot] = LoraWeights(a[name], b[name])
        optimizer = SlotOptimizer(spec, list(a.values()), list(b.values()))
        self.slots.bindings[slot] = Binding(
            registration_id, spec, targets, a, b, optimizer, OpLog(self.max_applied_ops)
        )
        self._update_slot_gauge()
        return self.slots.info(slot)

    def unbind(self, slot: int, registration_id: str) -> None:
        """Drop weights, gradients, moments and step count. Unbinding a free slot is a no-op."""
        self.slots.check_index(slot)
        current = self.slots.bindings[slot]
        if current is None:
            return
        if current.registration_id != registration_id:
            raise FailedPrecondition(
                f"slot {slot} is bound to another registration",
                field="registration_id",
                reason="LEASE_MISMATCH",
            )
        for name in current.targets:
            del self.wrappers[name].adapters[slot]
        self.slots.bindings[slot] = None
        self._update_slot_gauge()

    def _update_slot_gauge(self) -> None:
        bound = sum(b is not None for b in self.slots.bindings)
        metrics.SLOTS.labels(state="bound").set(bound)
        metrics.SLOTS.labels(state="free").set(len(self.slots) - bound)

    # ------------------------------------------------------------------ dedup helpers
    @staticmethod
    def _require_op_id(op_id: str, field: str = "operation_id") -> None:
        if not op_id:
            raise InvalidArgument("must not be empty", field=field)

    @staticmethod
    def _replay(binding: Binding, op_id: str, kind: type[_R]) -> _R:
        """The first result of an operation applied before; `kind` is what the caller's
        operation returns, so an id first used by another kind of operation is refused
        instead of answered with the other operation's result."""
        result = binding.ops.get(op_id)
        if result is RESULT_UNKNOWN:
            raise FailedPrecondition(
                "operation already applied (restored from a saved state); its result is gone",
                field="operation_id",
                reason="ALREADY_APPLIED",
            )
        if not isinstance(result, kind):
            raise FailedPrecondition(
                f"already used by an operation of another kind ({type(result).__name__})",
                field="operation_id",
                reason="ALREADY_APPLIED",
            )
        return result

    # ------------------------------------------------------------------ forward/backward
    def forward_backward(
        self, items: list[ForwardBackwardItem]
    ) -> list[ForwardBackwardOutput | LorafleetError]:
        """One pass over the shared base for every valid item; per-item results or errors."""
        start = time.perf_counter()
        results: list[Any] = [None] * len(items)
        plans: list[_Plan] = []
        first_of: dict[tuple[int, str], int] = {}
        duplicates: list[tuple[int, int]] = []
        for i, item in enumerate(items):
            try:
                binding = self.slots.leased(item.slot, item.registration_id)
                backward = not item.input.forward_only
                if backward:
                    self._require_op_id(item.operation_id)
                    if item.operation_id in binding.ops:
                        results[i] = self._replay(binding, item.operation_id, ForwardBackwardOutput)
                        continue
                    key = (item.slot, item.operation_id)
                    if key in first_of:
                        duplicates.append((i, first_of[key]))
                        continue
                    first_of[key] = i
                cfg, data = prepare_input(item.input, self.limits)
                plans.append(_Plan(i, binding, item.slot, cfg, data, backward))
            except LorafleetError as exc:
                results[i] = exc
        if plans:
            outputs: Sequence[ForwardBackwardOutput | LorafleetError]
            try:
                outputs = self._run(plans)
            except Exception as exc:  # a failed pass poisons every window it touched
                for plan in plans:
                    plan.binding.carried = None  # may hold a half-extended cache
                    if plan.backward:
                        plan.binding.optimizer.clear_gradients()
                        plan.binding.pending_datums = 0
                error = Internal(f"forward_backward failed: {exc}")
                outputs = [error] * len(plans)
            for plan, out in zip(plans, outputs, strict=True):
                results[plan.index] = out
                if plan.backward and not isinstance(out, LorafleetError):
                    item = items[plan.index]
                    tokens = sum(len(d.tokens) for d in plan.data)
                    plan.binding.pending_datums += len(plan.data)
                    plan.binding.tokens_trained += tokens
                    plan.binding.ops.record(item.operation_id, out)
                    metrics.TOKENS.inc(tokens)
        for i, first in duplicates:
            results[i] = results[first]
        metrics.OP_SECONDS.labels(kind="forward_backward").observe(time.perf_counter() - start)
        return results

    def _run(self, plans: list[_Plan]) -> list[ForwardBackwardOutput]:
        rows: list[tuple[_Plan, PreparedDatum]] = []
        windows: list[tuple[_Plan, PreparedDatum, RowGroup]] = []  # truncated-BPTT rows
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
                    windows.append(
                        (plan, d, RowGroup(plan.slot, 1, spec.rank, spec.scale, rate, keys))
                    )
                    continue
                group_rows.setdefault((plan.slot, dropout), []).append(len(rows))
                rows.append((plan, d))
                row_keys.append(key)
        dev = self.device
        share = self.share
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

        def score(plan: _Plan, d: PreparedDatum, logp: torch.Tensor) -> None:
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
        for b in bindings.values():
            b.optimizer.clear_gradients()
        # A group sums each slot's gradients over ranks in float64 (_join_gradients).
        self.router.residuals = {} if share.world > 1 else None
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
                    with self.router.route(groups, dev):
                        logits = self.model(input_ids=ids.to(dev), use_cache=False).logits
                    if share.world > 1 and need_grad:
                        zero_term = logits.sum() * 0.0  # every rank runs the same backward
                    logp_all = torch.log_softmax(logits.float(), dim=-1)
                    for r, (plan, d) in enumerate(local):
                        score(plan, d, logp_all[r, : len(d.tokens)])
                for plan, d, group in windows:
                    w = bptt.window_logits(
                        self.model,
                        self.router,
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
            self.router.residuals = None
            for slot, b in bindings.items():
                if slot not in summed:
                    for param, old in zip(b.optimizer.params, earlier[slot], strict=True):
                        param.grad = old
            raise
        self._join_gradients(bindings, summed, earlier)
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
        self,
        bindings: dict[int, Binding],
        summed: set[int],
        earlier: dict[int, list[torch.Tensor | None]],
    ) -> None:
        """Sum this pass's gradients over ranks (one all-reduce of every trained slot's LoRA
        gradients, replicated on every rank) and add them to the earlier accumulation; slots
        that only ran forward get their earlier gradients back, untouched.

        The all-reduce is in float64, each gradient with what its rounding to float32 lost
        (`Router.residuals`), so a slot whose rows were split between ranks gets the float32
        rounding of the same sum over its rows as in one process (lora.py), bit for bit."""
        residuals, self.router.residuals = self.router.residuals or {}, None
        trained = [p for slot in sorted(summed) for p in bindings[slot].optimizer.params]
        if self.share.world > 1 and trained:

            def exact(p: torch.Tensor) -> torch.Tensor:
                if p.grad is None:
                    return p.new_zeros(p.numel(), dtype=torch.float64)
                g = p.grad.to(torch.float64, copy=True)
                if id(p) in residuals:
                    g += residuals[id(p)]
                return g.reshape(-1)

            flat = torch.cat([exact(p) for p in trained])
            self.share.sum_gradients(flat)
            for p, g in zip(trained, flat.split([p.numel() for p in trained]), strict=True):
                p.grad = g.view_as(p).to(p.dtype)
        for slot, b in bindings.items():
            for p, old in zip(b.optimizer.params, earlier[slot], strict=True):
                if slot not in summed or p.grad is None:
                    p.grad = old
                elif old is not None:
                    p.grad = old + p.grad

    # ------------------------------------------------------------------ optimizer
    def optim_step(
        self, operation_id: str, slot: int, registration_id: str, hp: AdamParams
    ) -> OptimStepResult:
        start = time.perf_counter()
        binding = self.slots.leased(slot, registration_id)
        self._require_op_id(operation_id)
        if operation_id in binding.ops:
            return self._replay(binding, operation_id, OptimStepResult)
        validate_adam(hp)
        result = binding.optimizer.step(hp)
        if result.applied:
            metrics.OPTIM_STEPS.inc()
        elif result.metrics.get("vetoed"):
            metrics.NONFINITE_VETOES.inc()
        binding.pending_datums = 0
        binding.ops.record(operation_id, result)
        metrics.OP_SECONDS.labels(kind="optim_step").observe(time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------ state
    def _no_pending(self, binding: Binding, what: str) -> None:
        if binding.optimizer.has_gradients():
            raise FailedPrecondition(
                f"un-stepped gradients exist: optim_step before {what}",
                field="slot",
                reason="PENDING_GRADIENTS",
            )

    def _adapter_config(self, binding: Binding) -> dict[str, Any]:
        from peft import LoraConfig

        spec = binding.spec
        modules, parameters = peft_targets(binding.targets, self.sites)
        cfg = LoraConfig(
            r=spec.rank,
            # PEFT annotates lora_alpha as int, but fractional alphas are valid Tinker
            # options and PEFT only divides by them (scale = alpha / r).
            lora_alpha=spec.effective_alpha,  # type: ignore[arg-type]
            lora_dropout=spec.dropout,
            target_modules=modules,
            target_parameters=parameters or None,
            bias="none",
            task_type="CAUSAL_LM",
            base_model_name_or_path=self.base_model,
        )
        config: dict[str, Any] = cfg.to_dict()
        return config

    def _adapter_tensors(self, binding: Binding) -> dict[str, torch.Tensor]:
        """The slot's weights under PEFT's key names and layout (expert banks: see experts.py)."""
        out = {}
        prefixes = peft_prefixes(binding.targets, self.sites)
        for name in binding.targets:
            a, b = self.wrappers[name].to_peft(binding.a[name].detach(), binding.b[name].detach())
            out[f"{prefixes[name]}.lora_A.weight"] = a
            out[f"{prefixes[name]}.lora_B.weight"] = b
        return out

    def _param_keys(self, binding: Binding) -> list[str]:
        """PEFT key of each optimizer parameter, in SlotOptimizer.params order."""
        prefixes = peft_prefixes(binding.targets, self.sites)
        return [f"{prefixes[n]}.lora_A.weight" for n in binding.targets] + [
            f"{prefixes[n]}.lora_B.weight" for n in binding.targets
        ]

    def save_state(
        self, operation_id: str, slot: int, registration_id: str, name: str, include_optimizer: bool
    ) -> StateRef:
        start = time.perf_counter()
        binding = self.slots.leased(slot, registration_id)
        self._require_op_id(operation_id)
        if operation_id in binding.ops:
            return self._replay(binding, operation_id, StateRef)
        names.check_name(name)
        final = checkpoint.state_dir(self.storage_root, registration_id, name)
        earlier = checkpoint.saved_by(final, operation_id)
        if earlier is not None:  # this very operation, saved before its trainer was lost
            binding.ops.record(operation_id, earlier)
            return earlier
        self._no_pending(binding, "save_state")
        optimizer = None
        if include_optimizer:
            keys = self._param_keys(binding)
            optimizer = {}
            for i, (m, v) in binding.optimizer.moments().items():
                optimizer[keys[i] + ".exp_avg"] = m
                optimizer[keys[i] + ".exp_avg_sq"] = v
        spec = dataclasses.asdict(binding.spec)
        ref = checkpoint.save_state(
            final,
            adapter_config=self._adapter_config(binding),
            adapter=self._adapter_tensors(binding),
            optimizer=optimizer,
            trainer_state={
                "registration_id": registration_id,
                "base_model": self.base_model,
                "spec": {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items()},
                "targets": list(binding.targets),
                "optim_steps": binding.optimizer.steps,
                "has_optimizer": include_optimizer,
                "applied_ops": binding.ops.ids(),
                "saved_by": operation_id,
            },
        )
        binding.ops.record(operation_id, ref)
        # Jobs save at pass boundaries and at the end, where no window reads the carried
        # keys/values (a pass starts each document afresh): free them (up to the model's
        # positions of keys/values per slot) rather than hold them while the slot idles.
        binding.carried = None
        metrics.STATE_IO_SECONDS.labels(op="save").observe(time.perf_counter() - start)
        return ref

    def _check_weights(
        self, binding: Binding, tensors: dict[str, torch.Tensor], field: str
    ) -> None:
        """Same key set, same shapes, finite values: the shape fence of load and import."""
        expected = self._adapter_tensors(binding)
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        if missing or extra:
            what = f"missing {missing[0]}" if missing else f"unexpected {extra[0]}"
            raise FailedPrecondition(
                f"the adapter's modules differ from the slot's targets ({what})",
                field=field,
                reason="TARGET_MISMATCH",
            )
        for key, ref in expected.items():
            if tuple(tensors[key].shape) != tuple(ref.shape):
                raise FailedPrecondition(
                    f"{key} has shape {list(tensors[key].shape)}, the slot {list(ref.shape)}",
                    field=field,
                    reason="SHAPE_MISMATCH",
                )
            if not bool(torch.isfinite(tensors[key]).all()):
                raise FailedPrecondition(
                    f"{key} holds non-finite values", field=field, reason="NONFINITE_WEIGHTS"
                )

    def _assign(self, binding: Binding, tensors: dict[str, torch.Tensor]) -> None:
        """Copy PEFT-layout tensors into the slot; converts all before copying any."""
        prefixes = peft_prefixes(binding.targets, self.sites)
        shared = binding.spec.share_experts
        pairs = {}
        for name in binding.targets:
            key = prefixes[name]
            pairs[name] = self.wrappers[name].from_peft(
                tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"], shared, key
            )
        with torch.no_grad():
            for name, (a, b) in pairs.items():
                binding.a[name].copy_(a)
                binding.b[name].copy_(b)
        binding.carried = None  # keys/values of other weights: no window may read them now

    def load_state(
        self,
        operation_id: str,
        slot: int,
        registration_id: str,
        ref: StateRef,
        include_optimizer: bool,
    ) -> None:
        start = time.perf_counter()
        binding = self.slots.leased(slot, registration_id)
        self._require_op_id(operation_id)
        if operation_id in binding.ops:
            return self._replay(binding, operation_id, type(None))
        self._no_pending(binding, "load_state")
        state = checkpoint.open_state(self.storage_root, ref)
        saved = state.trainer_state
        spec = saved.get("spec", {})
        theirs = {"rank": spec.get("rank"), "alpha": contract.effective_alpha(spec.get("alpha", 0))}
        for key, mine in (("rank", binding.spec.rank), ("alpha", binding.spec.effective_alpha)):
            if theirs[key] != mine:
                raise FailedPrecondition(
                    f"{key} is {theirs[key]} in the saved state but {mine} in the slot",
                    field="manifest",
                    reason=f"{key.upper()}_MISMATCH",
                )
        if list(saved.get("targets", [])) != list(binding.targets):
            raise FailedPrecondition(
                "the saved state's target modules differ from the slot's",
                field="manifest",
                reason="TARGET_MISMATCH",
            )
        self._check_weights(binding, state.adapter, "manifest")
        moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if include_optimizer:
            if state.optimizer is None or not saved.get("has_optimizer"):
                raise FailedPrecondition(
                    "the saved state holds no optimizer state",
                    field="include_optimizer",
                    reason="NO_OPTIMIZER",
                )
            for i, key in enumerate(self._param_keys(binding)):
                if key + ".exp_avg" in state.optimizer:
                    moments[i] = (
                        state.optimizer[key + ".exp_avg"],
                        state.optimizer[key + ".exp_avg_sq"],
                    )
        self._assign(binding, state.adapter)
        binding.optimizer.restore(
            int(saved.get("optim_steps", 0)) if include_optimizer else 0, moments
        )
        binding.pending_datums = 0
        binding.ops.restore(list(saved.get("applied_ops", [])))
        binding.ops.record(operation_id, None)
        metrics.STATE_IO_SECONDS.labels(op="load").observe(time.perf_counter() - start)
        return None

    def export_adapter(self, slot: int, registration_id: str, folder: Path) -> None:
        """Write the slot's weights as an HF PEFT adapter folder."""
        start = time.perf_counter()
        binding = self.slots.leased(slot, registration_id)
        checkpoint.write_adapter(
            folder, self._adapter_config(binding), self._adapter_tensors(binding)
        )
        metrics.STATE_IO_SECONDS.labels(op="export").observe(time.perf_counter() - start)

    def import_adapter(
        self, operation_id: str, slot: int, registration_id: str, folder: Path
    ) -> None:
        """Load an HF PEFT adapter into a bound slot with the same rank, alpha and targets.

        The optimizer restarts (no moments, step 0): moments of other weights are meaningless.
        """
        start = time.perf_counter()
        binding = self.slots.leased(slot, registration_id)
        self._require_op_id(operation_id)
        if operation_id in binding.ops:
            return self._replay(binding, operation_id, type(None))
        self._no_pending(binding, "import_adapter")
        config, tensors = checkpoint.read_adapter(folder)
        if config.get("use_rslora") or config.get("use_dora"):
            raise FailedPrecondition(
                "rsLoRA and DoRA adapters are not supported",
                field="adapter",
                reason="UNSUPPORTED_ADAPTER",
            )
        for key, mine in (("r", binding.spec.rank), ("lora_alpha", binding.spec.effective_alpha)):
            if config.get(key) != mine:
                raise FailedPrecondition(
                    f"{key} is {config.get(key)} in the adapter but {mine} in the slot",
                    field="adapter",
                    reason=f"{key.upper()}_MISMATCH",
                )
        tensors = {k: v.to(torch.float32) for k, v in tensors.items()}
        self._check_weights(binding, tensors, "adapter")
        self._assign(binding, tensors)
        binding.optimizer.restore(0, {})
        binding.ops.record(operation_id, None)
        metrics.STATE_IO_SECONDS.labels(op="import").observe(time.perf_counter() - start)
        return None


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
