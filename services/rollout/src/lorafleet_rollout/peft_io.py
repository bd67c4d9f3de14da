"""Reading and checking PEFT LoRA adapters against a base model, before any engine state changes.

A pushed adapter must fit the base exactly: every tensor names an existing Linear module, has
lora_A [r, in] / lora_B [out, r] shapes, and the rank is within the engine's limit. Checking
here, on the caller's thread, means a bad adapter is refused with a clear message and the
running batch never sees it.

Expert banks (MoE `gate_up_proj` / `down_proj`, 3-D parameters) are PEFT `target_parameters`
LoRA, as the trainer exports them, in the layout `lorafleet.peft_experts` owns (keys and shapes).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file

from lorafleet import contract, peft_experts
from lorafleet.errors import InvalidArgument

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."


def read_peft_dir(folder: Path) -> tuple[LoraConfig, dict[str, torch.Tensor]]:
    """The LoraConfig and tensors of a PEFT folder, or InvalidArgument naming the file."""
    try:
        raw = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"unreadable: {exc}", field=CONFIG_FILE) from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise InvalidArgument(f"peft_type {raw.get('peft_type')!r} is not LORA", field=CONFIG_FILE)
    if raw.get("use_dora"):
        raise InvalidArgument("DoRA adapters are not supported", field=CONFIG_FILE)
    try:
        config = LoraConfig.from_pretrained(str(folder))
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except Exception as exc:
        raise InvalidArgument(
            f"not a loadable PEFT LoRA adapter: {exc}", field=WEIGHTS_FILE
        ) from None
    config.inference_mode = True
    return config, tensors


#: Expert module path -> {bank parameter: (experts, out, in)}, in the module's parameter order.
Banks = dict[str, dict[str, tuple[int, int, int]]]
EXPERT_BANKS = peft_experts.EXPERT_BANKS


def expert_banks(model: torch.nn.Module) -> Banks:
    """The 3-D expert banks of the unwrapped base (empty for a dense model)."""
    banks: Banks = {}
    for name, module in model.named_modules():
        for param, tensor in module.named_parameters(recurse=False):
            if param in EXPERT_BANKS and tensor.dim() == 3:
                experts, out, fan_in = tensor.shape
                banks.setdefault(name, {})[param] = (int(experts), int(out), int(fan_in))
    return banks


def _parameter_targeted(config: LoraConfig, name: str) -> bool:
    """PEFT's `target_parameters` match: the full name, or a dotted suffix of it."""
    patterns = getattr(config, "target_parameters", None) or []
    return any(contract.module_matches(name, p) for p in patterns)


def target_of(key: str, config: LoraConfig, banks: Banks) -> tuple[str, str]:
    """(target, "lora_A" | "lora_B") of a PEFT key: a Linear's module path, or an expert
    bank's "<experts module>.<parameter>". InvalidArgument if it is neither."""
    stem = key.removeprefix(_PREFIX)
    for kind in ("lora_A", "lora_B"):
        if stem.endswith(f".{kind}.weight"):
            module = stem.removesuffix(f".{kind}.weight")
            break
    else:
        raise InvalidArgument(f"{key!r} is not a LoRA A/B weight", field=WEIGHTS_FILE)
    module, hops = peft_experts.split_hops(module)
    if module not in banks:
        return stem.removesuffix(f".{kind}.weight"), kind
    targeted = [p for p in banks[module] if _parameter_targeted(config, f"{module}.{p}")]
    bank = peft_experts.bank_at(hops, targeted)
    if bank is None:
        raise InvalidArgument(
            f"{key!r} names no expert bank of {module} that target_parameters "
            f"{getattr(config, 'target_parameters', None)} selects",
            field=WEIGHTS_FILE,
        )
    return f"{module}.{bank}", kind


def linear_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """module path -> (in_features, out_features) of every Linear in the unwrapped base."""
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def check_fits(
    tensors: dict[str, torch.Tensor],
    config: LoraConfig,
    linears: dict[str, tuple[int, int]],
    max_rank: int,
    banks: Banks | None = None,
) -> None:
    """Raise InvalidArgument unless every tensor is a LoRA A/B of a base Linear (or expert
    bank, `banks`) within rank."""
    if not tensors:
        raise InvalidArgument("the adapter has no tensors", field=WEIGHTS_FILE)
    if not 1 <= config.r <= max_rank:
        raise InvalidArgument(
            f"rank {config.r} is outside [1, {max_rank}]", field="lora_config.rank"
        )
    for key, tensor in tensors.items():
        module, kind = target_of(key, config, banks or {})
        rank_dim = 0 if kind == "lora_A" else 1
        experts = 1
        if module in linears:
            fan_in, fan_out = linears[module]
        elif (bank := _bank(module, banks or {})) is not None:
            experts, fan_out, fan_in = bank
        else:
            raise InvalidArgument(
                f"{key!r} names no Linear module of the base model", field=WEIGHTS_FILE
            )
        total = tensor.shape[rank_dim] if tensor.dim() == 2 else -1
        rank = total // experts if total % experts == 0 else -1
        want = (total, fan_in) if rank_dim == 0 else (fan_out, total)
        if tuple(tensor.shape) != want or not 1 <= rank <= max_rank:
            per = f" ({experts} experts x rank)" if experts > 1 else ""
            raise InvalidArgument(
                f"{key!r} has shape {tuple(tensor.shape)}, expected {want}{per} with rank "
                f"<= {max_rank}",
                field=WEIGHTS_FILE,
            )
    # One sum over all tensors: any inf or NaN makes it non-finite (a per-tensor isfinite
    # took ~1.5 ms per publish on the bench model). A non-finite sum only says where to
    # look: finite values can overflow it, so the tensors are then checked one by one.
    if not torch.cat([t.reshape(-1) for t in tensors.values()]).sum().isfinite():
        for key, tensor in tensors.items():
            if not torch.isfinite(tensor).all():
                raise InvalidArgument(f"{key!r} holds non-finite values", field=WEIGHTS_FILE)


def _bank(target: str, banks: Banks) -> tuple[int, int, int] | None:
    module, _, param = target.rpartition(".")
    return banks.get(module, {}).get(param)
