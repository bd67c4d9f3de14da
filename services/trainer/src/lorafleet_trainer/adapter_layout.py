"""A slot's adapter in HF PEFT's layout: its config, key names and tensors, both ways.

Save, export, load and import all speak PEFT (`adapter_config.json` plus
`adapter_model.safetensors`), so one class owns the mapping between a slot's targets and
PEFT's module prefixes and layouts (expert banks: see experts.py), and the fence every
incoming adapter passes (same keys, same shapes, finite values) before any is copied in.
"""

from __future__ import annotations

from typing import Any

import torch

from lorafleet.errors import FailedPrecondition
from lorafleet_trainer.sites import Adaptable, Site
from lorafleet_trainer.slots import Binding
from lorafleet_trainer.targets import peft_prefixes, peft_targets


class AdapterLayout:
    """The PEFT view of the slots of one wrapped model."""

    def __init__(
        self, wrappers: dict[str, Adaptable], sites: tuple[Site, ...], base_model: str
    ) -> None:
        self.wrappers = wrappers
        self.sites = sites
        self.base_model = base_model

    def config(self, binding: Binding) -> dict[str, Any]:
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

    def tensors(self, binding: Binding) -> dict[str, torch.Tensor]:
        """The slot's weights under PEFT's key names and layout (expert banks: see experts.py)."""
        out = {}
        prefixes = peft_prefixes(binding.targets, self.sites)
        for name in binding.targets:
            a, b = self.wrappers[name].to_peft(binding.a[name].detach(), binding.b[name].detach())
            out[f"{prefixes[name]}.lora_A.weight"] = a
            out[f"{prefixes[name]}.lora_B.weight"] = b
        return out

    def param_keys(self, binding: Binding) -> list[str]:
        """PEFT key of each optimizer parameter, in SlotOptimizer.params order."""
        prefixes = peft_prefixes(binding.targets, self.sites)
        return [f"{prefixes[n]}.lora_A.weight" for n in binding.targets] + [
            f"{prefixes[n]}.lora_B.weight" for n in binding.targets
        ]

    def check(self, binding: Binding, tensors: dict[str, torch.Tensor], field: str) -> None:
        """Same key set, same shapes, finite values: the shape fence of load and import."""
        expected = self.tensors(binding)
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

    def assign(self, binding: Binding, tensors: dict[str, torch.Tensor]) -> None:
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
