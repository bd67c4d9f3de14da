"""TrainerEngine: one base model, N fixed LoRA slots, exact per-slot training.

Synchronous and single-threaded by design (torch is not re-entrant here): the servicer
runs every call on one worker thread, which also makes each slot run one op at a time.
Every mutating call validates everything first and only then changes state, and each
carries an operation id: a repeated id returns the first result instead of applying twice.
The engine owns the slots and that discipline; the pass itself is `batch_pass.run_pass`, and
the PEFT layout of saved, exported and imported adapters is `adapter_layout.AdapterLayout`.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from lorafleet import contract, names, quantize
from lorafleet.contract import LOSS_NAMES, OPTIMIZERS
from lorafleet.errors import FailedPrecondition, Internal, InvalidArgument, LorafleetError
from lorafleet.validate_msgs import Limits
from lorafleet_trainer import checkpoint, metrics
from lorafleet_trainer.adapter_layout import AdapterLayout
from lorafleet_trainer.batch_pass import Plan, run_pass
from lorafleet_trainer.domain import (
    AdamParams,
    ForwardBackwardItem,
    ForwardBackwardOutput,
    LoraSpec,
    OptimStepResult,
    SlotInfo,
    StateRef,
)
from lorafleet_trainer.lora import LoraWeights, Router
from lorafleet_trainer.losses import (
    prepare_input,
)
from lorafleet_trainer.optim import SlotOptimizer, validate_adam
from lorafleet_trainer.quantized import quantize_base
from lorafleet_trainer.rowshare import RowShare, Single
from lorafleet_trainer.sites import wrap_model
from lorafleet_trainer.slots import RESULT_UNKNOWN, Binding, OpLog, SlotTable
from lorafleet_trainer.targets import resolve_targets

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_R = TypeVar("_R")


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
        self.layout = AdapterLayout(self.wrappers, self.sites, base_model)
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
        plans: list[Plan] = []
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
                plans.append(Plan(i, binding, item.slot, cfg, data, backward))
            except LorafleetError as exc:
                results[i] = exc
        if plans:
            outputs: Sequence[ForwardBackwardOutput | LorafleetError]
            try:
                outputs = run_pass(self.model, self.router, self.device, self.share, plans)
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
            keys = self.layout.param_keys(binding)
            optimizer = {}
            for i, (m, v) in binding.optimizer.moments().items():
                optimizer[keys[i] + ".exp_avg"] = m
                optimizer[keys[i] + ".exp_avg_sq"] = v
        spec = dataclasses.asdict(binding.spec)
        ref = checkpoint.save_state(
            final,
            adapter_config=self.layout.config(binding),
            adapter=self.layout.tensors(binding),
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
        self.layout.check(binding, state.adapter, "manifest")
        moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if include_optimizer:
            if state.optimizer is None or not saved.get("has_optimizer"):
                raise FailedPrecondition(
                    "the saved state holds no optimizer state",
                    field="include_optimizer",
                    reason="NO_OPTIMIZER",
                )
            for i, key in enumerate(self.layout.param_keys(binding)):
                if key + ".exp_avg" in state.optimizer:
                    moments[i] = (
                        state.optimizer[key + ".exp_avg"],
                        state.optimizer[key + ".exp_avg_sq"],
                    )
        self.layout.assign(binding, state.adapter)
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
        checkpoint.write_adapter(folder, self.layout.config(binding), self.layout.tensors(binding))
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
        self.layout.check(binding, tensors, "adapter")
        self.layout.assign(binding, tensors)
        binding.optimizer.restore(0, {})
        binding.ops.record(operation_id, None)
        metrics.STATE_IO_SECONDS.labels(op="import").observe(time.perf_counter() - start)
        return None
