"""The model's inventory of weight matrices, each a LoRA target ("site") or not.

At start-up every module that owns a matrix (a parameter of 2 or more dimensions) is listed
once: an `nn.Linear` (fused ones too: Phi-3's `qkv_proj` and `gate_up_proj` are Linears
whose LoRA is PEFT's on the fused output) is wrapped by `MultiLoraLinear`; each fused expert
bank of a standard MoE experts module (`gate_up_proj`, `down_proj`) is wrapped through
`MultiLoraExperts`; anything else (GPT-2's Conv1D, a non-standard expert layout, a router's
raw weight, embeddings) is listed as not adaptable. `targets.py` resolves a registration
against this list and refuses one that asks for a matrix it cannot adapt, naming it,
instead of training a silently smaller adapter.

Each site gets a category from its module path: `attn` (a path part containing "attn" or
"attention"), `mlp` ("mlp", "feed_forward", "ffn", "moe", "experts"), `unembed` (the output
embeddings), `router` (an MoE gate: asked for only by name) or `other`.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lorafleet_trainer.experts import BANKS, ExpertBank, MultiLoraExperts, is_standard_experts
from lorafleet_trainer.lora import MultiLoraLinear, Router

ATTN_WORDS = ("attn", "attention")
MLP_WORDS = ("mlp", "feed_forward", "ffn", "moe", "experts")
ROUTERS = ("gate", "router", "shared_expert_gate")

# A wrapped site: anything with adapters, in/out features, init_weights, to_peft and from_peft.
Adaptable = MultiLoraLinear | ExpertBank


@dataclass(frozen=True)
class Site:
    name: str  # a Linear's module name, or "<module>.<parameter>"
    module: str  # the module owning the matrix
    category: str  # attn | mlp | unembed | router | other
    kind: str  # linear | experts | unsupported (with the module's type in `why`)
    why: str = ""

    @property
    def adaptable(self) -> bool:
        return self.kind != "unsupported"


def category(module_name: str, is_output: bool) -> str:
    parts = module_name.split(".")
    if is_output:
        return "unembed"
    if parts[-1] in ROUTERS:
        return "router"
    if any(w in p for p in parts for w in ATTN_WORDS):
        return "attn"
    if any(w in p for p in parts for w in MLP_WORDS):
        return "mlp"
    return "other"


def wrap_model(model: nn.Module, router: Router) -> tuple[dict[str, Adaptable], tuple[Site, ...]]:
    """Wrap every adaptable site of `model` in place; returns them by name, and the inventory."""
    get_output = getattr(model, "get_output_embeddings", None)  # transformers models have it
    output = get_output() if get_output is not None else None
    sites: list[Site] = []
    wrappers: dict[str, Adaptable] = {}
    for name, module in list(model.named_modules()):
        if not name:
            continue
        cat = category(name, module is output)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(module, nn.Linear):
            wrapper = MultiLoraLinear(module, name, router)
            setattr(parent, attr, wrapper)
            wrappers[name] = wrapper
            sites.append(Site(name, name, cat, "linear"))
            continue
        matrices = [p for p, t in module.named_parameters(recurse=False) if t.dim() >= 2]
        if not matrices:
            continue
        experts = None
        if is_standard_experts(module):
            experts = MultiLoraExperts(module, router)
            setattr(parent, attr, experts)
        for p in matrices:
            site = f"{name}.{p}"
            if experts is not None and p in BANKS:
                wrappers[site] = experts.banks[p]
                sites.append(Site(site, name, cat, "experts"))
            else:
                sites.append(Site(site, name, cat, "unsupported", type(module).__name__))
    return wrappers, tuple(sites)
