"""Our adapters in the layout SGLang 0.5.23 loads, checked against the server before it sees them.

Why this exists: SGLang reads only `r`, `lora_alpha`, `target_modules` and `use_dora` from
adapter_config.json (`srt/lora/lora_config.py`) and maps each weight key to one of its own
modules by substring (`srt/lora/utils.py` get_target_module_name). A key that maps to nothing
is only logged at load; the first batch using the adapter then raises inside the scheduler
(`srt/lora/mem_pool.py` load_lora_weight_to_buffer), which kills the server and every adapter
on it. So nothing reaches `/load_lora_adapter` unless every key maps, every target is among
the server's `--lora-target-modules` and the rank is within `--max-lora-rank`; anything else
is refused here with the reason, and the server never sees it.

Expert LoRA. Our trainer exports adapters on fused expert banks as PEFT's `target_parameters`
LoRA: one key pair per bank, `...mlp.experts[.base_layer].lora_A.weight` of shape
(experts * rank, in) and `lora_B.weight` of shape (out, rank * experts) with expert-interleaved
columns (`lorafleet.peft_experts`, the layout's one owner). SGLang names per-expert LoRA after
its own modules, one 2-D pair per expert: `...experts.{e}.gate_up_proj.lora_A.weight` (rank,
hidden) and `lora_B.weight` (2 * intermediate, rank), `...experts.{e}.down_proj.*` likewise,
and puts them in its `gate_up_proj_moe` / `down_proj_moe` buffers (mem_pool.py, the
`experts\\.(\\d+)\\.` branch). A fused `gate_up_proj` A is shared by the gate and up halves, which
is exactly what SGLang does with an already-stacked `gate_up_proj` A (normalize_gate_up_proj
repeats it for both halves), so `B_e A_e` is served unchanged. Which bank a key pair is comes
from its shapes: gate_up maps hidden -> 2 * intermediate and down maps intermediate -> hidden,
never both. SGLang wraps an MoE layer for LoRA only when both gate_up_proj and down_proj are
server targets (`lora_manager.py`), so expert adapters need both there. Serving them takes
SGLang's Triton fused-MoE LoRA runner, so a GPU: on its CPU backend an MoE model with LoRA
targets on the experts dies in start-up warm-up (`fused_moe_triton_config.py`
get_device_name() is None), before any adapter.

Stacked projections. SGLang fuses q/k/v and gate/up LoRA per layer and cannot load a q_proj
without v_proj (KeyError) nor place a k_proj, v_proj or up_proj alone; `complete_stacks` adds
the missing partners as zero LoRA, which changes no output.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lorafleet import peft_experts
from lorafleet.errors import InvalidArgument

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: `--lora-target-modules` choices in 0.5.23 (`srt/utils/common.py`
#: SUPPORTED_LORA_TARGET_MODULES); "all" stands for every one of them.
SUPPORTED_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "kv_a_proj_with_mqa",
    "q_b_proj",
    "kv_b_proj",
    "wq_b",
    "wk",
    "weights_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "embed_tokens",
    "lm_head",
    "qkvr",
    "wo_ud",
)
ALL_TARGETS = "all"

#: SGLang's own names for the modules a target stands for (`get_normalized_target_modules`).
_NORMALIZED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "unembed_tokens": "lm_head",
    "output": "lm_head",
    "vocab_emb": "embed_tokens",
    "embeddings": "embed_tokens",
    "word_embeddings": "embed_tokens",
    "q_a_proj": "fused_qkv_a_proj_with_mqa",
    "kv_a_proj_with_mqa": "fused_qkv_a_proj_with_mqa",
    "wq_b": "indexer.wq_b",
    "wk": "indexer.wk",
    "weights_proj": "indexer.weights_proj",
}
_EMBEDDINGS = ("embed_tokens", "lm_head")
_MOE_TARGETS = frozenset({"gate_up_proj", "down_proj"})
#: The expert banks SGLang serves, as PEFT `target_parameters` name them (module.param).
EXPERT_BANKS = tuple(f"experts.{p}" for p in peft_experts.EXPERT_BANKS)

_EXPERT_KEY = re.compile(r"^(?P<prefix>.+)\.lora_(?P<ab>[AB])\.weight$")
_LAYER = re.compile(r"layers\.(\d+)\.")


def normalize_targets(names: list[str] | str) -> frozenset[str]:
    """SGLang's module names for PEFT or server target names ("all" = every supported one)."""
    if isinstance(names, str):
        if names not in (ALL_TARGETS, "all-linear"):
            raise InvalidArgument(
                f"target_modules {names!r}: only 'all' or 'all-linear' may be a string",
                field="adapter.target_modules",
            )
        names = list(SUPPORTED_TARGETS)
    return frozenset(_NORMALIZED.get(n.split(".")[-1], n.split(".")[-1]) for n in names)


@dataclass(frozen=True)
class ServerLora:
    """What the SGLang server was started with (its /server_info)."""

    #: SGLang module names, already normalized (q_proj -> qkv_proj, ...).
    targets: frozenset[str]
    max_rank: int

    @classmethod
    def from_flags(cls, target_modules: list[str] | None, max_rank: int) -> ServerLora:
        """From --lora-target-modules (None or ["all"]: every supported module)."""
        names: list[str] | str = ALL_TARGETS
        if target_modules and ALL_TARGETS not in target_modules:
            names = list(target_modules)
        return cls(normalize_targets(names), max_rank)


@dataclass(frozen=True)
class ModelShape:
    """The base model's projection sizes (from its config), for the weights we write."""

    hidden: int
    q_out: int
    kv_out: int
    intermediate: int
    #: Expert banks; zero experts: a dense model.
    num_experts: int = 0
    moe_intermediate: int = 0

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0)
        inter = int(config.intermediate_size)
        return cls(
            hidden=int(config.hidden_size),
            q_out=heads * int(head_dim),
            kv_out=int(kv_heads) * int(head_dim),
            intermediate=inter,
            num_experts=int(experts or 0),
            moe_intermediate=int(getattr(config, "moe_intermediate_size", None) or inter),
        )

    def bank_of(self, a: torch.Tensor, b: torch.Tensor, rank: int) -> str | None:
        """ "gate_up_proj" or "down_proj" for a PEFT expert key pair of these shapes, else None."""
        e = self.num_experts
        if e == 0 or a.dim() != 2 or b.dim() != 2:
            return None
        if a.shape[0] != e * rank or b.shape[1] != e * rank:
            return None
        shape = (a.shape[1], b.shape[0])
        if shape == (self.hidden, 2 * self.moe_intermediate):
            return "gate_up_proj"
        if shape == (self.moe_intermediate, self.hidden):
            return "down_proj"
        return None

    def out_features(self, module: str) -> int:
        return {"q_proj": self.q_out, "v_proj": self.kv_out, "gate_proj": self.intermediate}[module]


#: Stacks SGLang fuses per layer, and the members it cannot do without: it stacks q_proj with
#: v_proj (a missing k_proj becomes zeros) and gate_proj with up_proj (a missing up_proj becomes
#: zeros); a q_proj without v_proj raises a KeyError at load and a k_proj, v_proj or up_proj
#: without its partner maps to no module (`lora.py` normalize_qkv_proj / normalize_gate_up_proj).
_STACKS = {
    "q_proj": ("q_proj", "v_proj"),
    "k_proj": ("q_proj", "v_proj"),
    "v_proj": ("q_proj", "v_proj"),
    "gate_proj": ("gate_proj",),
    "up_proj": ("gate_proj",),
}
_STACKED_KEY = re.compile(
    r"^(?P<prefix>.+)\.(?P<module>q_proj|k_proj|v_proj|gate_proj|up_proj)\.lora_[AB]\.weight$"
)


def complete_stacks(
    tensors: dict[str, torch.Tensor], rank: int, shape: ModelShape
) -> dict[str, torch.Tensor]:
    """Add the zero LoRA (A and B zero: no change to any output) each stack needs to load."""
    needed: dict[str, set[str]] = {}
    for key in tensors:
        m = _STACKED_KEY.match(key)
        if m is not None:
            needed.setdefault(m["prefix"], set()).update(_STACKS[m["module"]])
    out = dict(tensors)
    for prefix, modules in needed.items():
        for module in modules:
            a_key = f"{prefix}.{module}.lora_A.weight"
            if a_key in out:
                continue
            dtype = next(iter(tensors.values())).dtype
            out[a_key] = torch.zeros(rank, shape.hidden, dtype=dtype)
            out[f"{prefix}.{module}.lora_B.weight"] = torch.zeros(
                shape.out_features(module), rank, dtype=dtype
            )
    return out


def sglang_module(key: str, targets: frozenset[str]) -> str | None:
    """The server module a (converted) weight key loads into, as SGLang maps it, or None.

    Layer weights are matched by substring after SGLang's renames (q/k/v -> qkv_proj,
    gate/up -> gate_up_proj), longest match first; lm_head/embed_tokens by name.
    """
    name = key
    for old, new in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"), ("v_proj", "qkv_proj")):
        name = name.replace(f".{old}.", f".{new}.")
    for old in ("gate_proj", "up_proj"):
        if ".gate_up_proj." not in name:
            name = name.replace(f".{old}.", ".gate_up_proj.")
    if _LAYER.search(name) is None:
        module = next((m for m in _EMBEDDINGS if m in name), None)
        return module if module in targets else None
    matches = [t for t in targets if t in name]
    return max(matches, key=len) if matches else None


def _refuse(message: str) -> InvalidArgument:
    return InvalidArgument(f"SGLang cannot serve this adapter: {message}", field="adapter")


def _check_config(config: dict[str, Any], server: ServerLora) -> None:
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _refuse(f"peft_type {config.get('peft_type')} is not LORA")
    for flag in ("use_dora", "use_rslora"):
        if config.get(flag):
            raise _refuse(f"{flag} is set (SGLang applies plain alpha / r LoRA)")
    for pattern in ("rank_pattern", "alpha_pattern"):
        if config.get(pattern):
            raise _refuse(f"{pattern} is set (SGLang reads one r and lora_alpha)")
    if config.get("modules_to_save"):
        raise _refuse("modules_to_save is set (SGLang loads LoRA weights only)")
    if config.get("bias", "none") != "none":
        raise _refuse(f"bias={config['bias']!r} (SGLang loads no LoRA bias)")
    rank = int(config.get("r", 0))
    if not 1 <= rank <= server.max_rank:
        raise _refuse(f"rank {rank} is outside the server's --max-lora-rank {server.max_rank}")
    banks = config.get("target_parameters") or []
    odd = [p for p in banks if ".".join(str(p).split(".")[-2:]) not in EXPERT_BANKS]
    if odd:
        raise _refuse(
            f"target_parameters {odd}: SGLang serves expert LoRA only on {list(EXPERT_BANKS)}"
        )


def convert(
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    server: ServerLora,
    shape: ModelShape,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config, weights) in SGLang's layout, or InvalidArgument naming what cannot be
    served. Dense keys pass unchanged, with zero partners where a stack needs them
    (`complete_stacks`); expert banks are split per expert (module docstring)."""
    _check_config(config, server)
    rank = int(config["r"])
    out: dict[str, torch.Tensor] = {}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    expert_keys: dict[str, list[str]] = {}
    for key, tensor in tensors.items():
        m = _EXPERT_KEY.match(key)
        module = "" if m is None else peft_experts.split_hops(m["prefix"])[0]
        if m is None or not module.endswith(".experts"):
            out[key] = tensor
            continue
        # A module's banks differ only in their `.base_layer` hops (`peft_experts`); group by
        # the full prefix, pair A with B, and tell the banks apart by shape.
        pairs.setdefault(m["prefix"], {})[m["ab"]] = tensor
        expert_keys.setdefault(module, []).append(m["prefix"])
    out = complete_stacks(out, rank, shape)
    banks: set[str] = set()
    for module, prefixes in expert_keys.items():
        seen: set[str] = set()
        for prefix in dict.fromkeys(prefixes):
            pair = pairs[prefix]
            if set(pair) != {"A", "B"}:
                raise _refuse(f"{prefix} has lora_A or lora_B but not both")
            bank = shape.bank_of(pair["A"], pair["B"], rank)
            if bank is None or bank in seen:
                raise _refuse(
                    f"{prefix}: shapes A {tuple(pair['A'].shape)}, B {tuple(pair['B'].shape)} "
                    f"are not a rank-{rank} LoRA on this model's expert banks "
                    f"({shape.num_experts} experts, hidden {shape.hidden}, "
                    f"intermediate {shape.moe_intermediate})"
                )
            seen.add(bank)
            a, b = peft_experts.from_peft(pair["A"], pair["B"], shape.num_experts)
            for i in range(shape.num_experts):
                out[f"{module}.{i}.{bank}.lora_A.weight"] = a[i].contiguous()
                out[f"{module}.{i}.{bank}.lora_B.weight"] = b[i].contiguous()
        banks |= seen
    dense = config.get("target_modules") or []
    wanted = normalize_targets(dense) | banks
    missing = sorted(wanted - server.targets)
    if missing:
        raise _refuse(
            f"targets {missing} are not among the server's --lora-target-modules "
            f"{sorted(server.targets)}"
        )
    if banks and not server.targets >= _MOE_TARGETS:
        raise _refuse(
            "expert LoRA needs both gate_up_proj and down_proj in the server's "
            f"--lora-target-modules (it has {sorted(server.targets)})"
        )
    unmapped = sorted(k for k in out if sglang_module(k, server.targets) is None)
    if unmapped:
        raise _refuse(f"weights that map to no SGLang module: {unmapped[:8]}")
    if not banks:
        return config, out
    converted = {k: v for k, v in config.items() if k != "target_parameters"}
    # "all"/"all-linear" already covers the banks; a list names them beside the dense targets.
    converted["target_modules"] = dense if isinstance(dense, str) else sorted({*dense, *banks})
    return converted, out


def publish(source: Path, dest: Path, server: ServerLora, shape: ModelShape) -> None:
    """Write `source` (our PEFT export) to the new folder `dest` in the layout SGLang loads.

    Everything is checked before `dest` is created. An adapter SGLang loads as it is is
    hard-linked (no copy) when the filesystem allows it.
    """
    try:
        config = json.loads((source / CONFIG_FILE).read_text())
        tensors = load_file(str(source / WEIGHTS_FILE))
    except (OSError, ValueError) as exc:
        raise InvalidArgument(f"unreadable adapter folder: {exc}", field="adapter") from None
    converted, weights = convert(config, tensors, server, shape)
    dest.mkdir(parents=True)
    try:
        if converted == config and weights.keys() == tensors.keys():
            for name in (CONFIG_FILE, WEIGHTS_FILE):
                _link_or_copy(source / name, dest / name)
        else:
            (dest / CONFIG_FILE).write_text(json.dumps(converted, indent=2))
            save_file(weights, str(dest / WEIGHTS_FILE))
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
