"""Reading and checking PEFT LoRA adapters against a base model, before any engine state changes.

A pushed adapter must fit the base exactly: every tensor names an existing Linear module, has
lora_A [r, in] / lora_B [out, r] shapes, and the rank is within the engine's limit. Checking
here, on the caller's thread, means a bad adapter is refused with a clear message and the
running batch never sees it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import LoraConfig
from safetensors.torch import load_file

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
) -> None:
    """Raise InvalidArgument unless every tensor is a LoRA A/B of a base Linear within rank."""
    if not tensors:
        raise InvalidArgument("the adapter has no tensors", field=WEIGHTS_FILE)
    if not 1 <= config.r <= max_rank:
        raise InvalidArgument(
            f"rank {config.r} is outside [1, {max_rank}]", field="lora_config.rank"
        )
    for key, tensor in tensors.items():
        stem = key.removeprefix(_PREFIX)
        if stem.endswith(".lora_A.weight"):
            module, rank_dim = stem.removesuffix(".lora_A.weight"), 0
        elif stem.endswith(".lora_B.weight"):
            module, rank_dim = stem.removesuffix(".lora_B.weight"), 1
        else:
            raise InvalidArgument(f"{key!r} is not a LoRA A/B weight", field=WEIGHTS_FILE)
        if module not in linears:
            raise InvalidArgument(
                f"{key!r} names no Linear module of the base model", field=WEIGHTS_FILE
            )
        fan_in, fan_out = linears[module]
        rank = tensor.shape[rank_dim] if tensor.dim() == 2 else -1
        want = (rank, fan_in) if rank_dim == 0 else (fan_out, rank)
        if tuple(tensor.shape) != want or not 1 <= rank <= max_rank:
            raise InvalidArgument(
                f"{key!r} has shape {tuple(tensor.shape)}, expected {want} with rank <= {max_rank}",
                field=WEIGHTS_FILE,
            )
    # One sum over all tensors: any inf or NaN makes it non-finite (a per-tensor isfinite
    # took ~1.5 ms per publish on the bench model). A non-finite sum only says where to
    # look: finite values can overflow it, so the tensors are then checked one by one.
    if not torch.cat([t.reshape(-1) for t in tensors.values()]).sum().isfinite():
        for key, tensor in tensors.items():
            if not torch.isfinite(tensor).all():
                raise InvalidArgument(f"{key!r} holds non-finite values", field=WEIGHTS_FILE)
