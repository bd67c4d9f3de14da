"""The torch engine's forward pass: a Llama-family decoder written for CPU decoding.

Why not transformers' forward: decode is bound by the bytes it streams (every weight once per
step, every row's keys/values) and, at a few dozen rows, by the Python-level ops around them.
Here the weights are packed once (`pack`, oneDNN's layout), q/k/v and gate/up are fused into
one GEMM each, q and k are rotated together from precomputed tables, the KV cache is a set of
per-sequence slots written in place (`SlotCache`), decode attention is one native call per
layer that writes the step's keys/values and reads each row's own columns once
(`kernels.py`), each projection's LoRA is one native call over the rows grouped by adapter
(`lora.py`), and prompt prefixes that several rows share are read once per step for all of
them (`Segment`: one native call per layer over every segment, `kernels.DecodeShared`; or
`Decoder._merge` in torch).

Where a decode step goes (bench model, 16 rows x ~100 columns, one thread, profiled): ~65 %
the projection GEMMs (oneDNN at 16 rows: ~46 GFLOP/s, streaming 84 MB of weights from DRAM
without overlapping compute), ~8 % attention, the rest elementwise ops and Python.

The arithmetic is transformers' (the same RMSNorm, rotate-half rotary from the model's own
rotary module, so rope scaling variants match, partial rotary too, softmax attention with the
same scaling); tests hold logprobs to 1e-4 of transformers + PEFT. The families served are
`lorafleet.families`' rule (the one `lorafleet up` checks): Llama, Mistral, Qwen2, Qwen3,
Phi-3 (fused `qkv_proj` and `gate_up_proj`: one Projection each, its LoRA PEFT's on the
fused output), and the Qwen MoEs (`Moe`: top-k routing, per-expert LoRA, Qwen2-MoE's gated
shared expert). A sliding window caps the context at the window instead: every key is then
inside it, so attention is exact without a windowed mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from lorafleet.errors import InvalidArgument
from lorafleet.families import torch_engine_refusal
from lorafleet_rollout import kernels
from lorafleet_rollout.lora import AdapterWeights, ExpertStacks, LoraStacks, Route, SlotWeights

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

_M = TypeVar("_M", bound=nn.Module)
#: The LoRA stacks of one projection or expert bank.
Stacks = LoraStacks | ExpertStacks


#: Rows [first, last) of a prefill batch that go through adapter slot `slot` (others: base).
Spans = list[tuple[int, int, int]]


@dataclass
class PrefillPart:
    """Prompt tokens [T] at positions start.. of one sequence whose first `start` keys and
    values are in keys/values (per layer [kv_heads, >= start + T, dim], written in place)."""

    tokens: torch.Tensor
    start: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    slot: int


#: oneDNN's prepacked fp32 GEMM: decode is weight-bandwidth bound at a few dozen rows, and
#: a weight packed once into oneDNN's blocked layout streams faster than MKL's `x @ W`, which
#: repacks W on every call (decode steps of the bench model ~1.2x faster, measured side by
#: side; vLLM's CPU backend does the same).
_ONEDNN = torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A linear weight [out, in] in the layout `linear` multiplies fastest."""
    if _ONEDNN:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 16)
    return weight.t().contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] times a `pack`ed weight (+ bias): [M, out]."""
    if _ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return x @ weight if bias is None else torch.addmm(bias, x, weight)


class Projection:
    """A (fused) linear layer: packed weight, optional bias, and its LoRA stacks."""

    def __init__(self, linears: list[nn.Linear], native: kernels.DecodeLora | None) -> None:
        self.weight = pack(torch.cat([m.weight.detach() for m in linears]))
        biases = [m.bias for m in linears]
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat(
                [
                    m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                    for m in linears
                ]
            )
        )
        self.lora = LoraStacks(
            linears[0].in_features, tuple(m.out_features for m in linears), native
        )

    def __call__(self, x: torch.Tensor, adapter: Route | Spans | None) -> torch.Tensor:
        out = linear(x, self.weight, self.bias)
        if isinstance(adapter, Route):
            self.lora.add_routed(out, x, adapter)
        elif adapter:
            for first, last, slot in adapter:
                self.lora.add_one(out[first:last], x[first:last], slot)
        return out


@dataclass(frozen=True)
class LaidOut:
    """An adapter ready to install (`Decoder.lay_out`): its largest rank, and its weights
    per targeted stack."""

    rank: int
    stacks: dict[Stacks, SlotWeights]


def _fused(owner: nn.Module, fused: str, parts: tuple[str, ...]) -> list[nn.Linear]:
    """The Linears of a fused projection: Phi-3's one `fused` Linear, else the `parts`
    (concatenated here in the same output order)."""
    one = getattr(owner, fused, None)
    return [one] if isinstance(one, nn.Linear) else [_child(owner, n, nn.Linear) for n in parts]


def _child(owner: nn.Module, name: str, kind: type[_M]) -> _M:
    """owner.name, checked to be a `kind` (nn.Module attributes are untyped)."""
    child = getattr(owner, name)
    if not isinstance(child, kind):
        raise TypeError(f"{type(owner).__name__}.{name} is not a {kind.__name__}")
    return child


class Mlp:
    """A gated MLP: gate and up as one GEMM (Phi-3 stores them fused already), then down."""

    def __init__(self, mlp: nn.Module, native: kernels.DecodeLora | None) -> None:
        self.gate_up_linears = _fused(mlp, "gate_up_proj", ("gate_proj", "up_proj"))
        self.down_linear = _child(mlp, "down_proj", nn.Linear)
        self.gate_up = Projection(self.gate_up_linears, native)
        self.down = Projection([self.down_linear], native)

    def projections(self) -> list[tuple[Projection, list[nn.Linear]]]:
        return [(self.gate_up, self.gate_up_linears), (self.down, [self.down_linear])]

    def __call__(
        self, x: torch.Tensor, adapter: Route | Spans | None, slots: torch.Tensor | None
    ) -> torch.Tensor:
        gate, up = self.gate_up(x, adapter).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up, adapter)


class Moe:
    """A sparse MoE block (Qwen3-MoE; Qwen2-MoE adds a gated shared expert), as transformers
    runs it: router softmax (float32) over experts, top-k, renormalised when the config's
    `norm_topk_prob` says so, each expert a gated MLP on its fused [gate; up] bank, outputs
    weighted and summed per token. Per-expert LoRA on either bank (`ExpertStacks`, the
    trainer's target_parameters adapters); the router takes none (the trainer cannot adapt
    its raw weight either), the shared expert's Linears take LoRA like any MLP's.

    The (token, expert) pairs are sorted by expert once, so each expert is one GEMM over its
    rows and the LoRA of every pair is one gathered `bmm` per bank, whatever the mix of
    adapters. Torch ops only, and this is where a native kernel would pay next: on the tiny
    MoE (16 rows decoding, bench/moe_decode.py, one thread) these blocks took ~48 % of the
    engine's time on the base model and ~57 % with two adapters, the per-expert LoRA ~18 %
    (its gather copies each pair's A and B). Most of it is per-op overhead at small sizes
    (argsort, bincount, one GEMM per hit expert per layer): a grouped kernel over the pairs,
    reading the banks and stacks in place like `kernels.DecodeLora`, would remove both.
    """

    def __init__(
        self, block: nn.Module, config: PretrainedConfig, native: kernels.DecodeLora | None
    ) -> None:
        experts = _child(block, "experts", nn.Module)
        if not _standard_experts(experts):
            raise InvalidArgument(
                f"{type(experts).__name__}: expert banks other than transformers' fused "
                "[gate; up] / down layout are not supported by the torch engine",
                field="model_path",
            )
        gate_up, down = (_tensor(experts, bank) for bank in ("gate_up_proj", "down_proj"))
        self.num_experts, inter2, hidden = (int(n) for n in gate_up.shape)
        self.top_k = int(config.num_experts_per_tok)
        self.norm_topk = bool(getattr(config, "norm_topk_prob", False))
        self.router = pack(_detached_weight(_child(block, "gate", nn.Module)))
        self.gate_up = [pack(w) for w in gate_up]
        self.down = [pack(w) for w in down]
        self.gate_up_lora = ExpertStacks(self.num_experts, hidden, inter2)
        self.down_lora = ExpertStacks(self.num_experts, inter2 // 2, hidden)
        shared = getattr(block, "shared_expert", None)
        self.shared = None if shared is None else Mlp(shared, native)
        shared_gate = getattr(block, "shared_expert_gate", None)
        self.shared_gate = None if shared_gate is None else Projection([shared_gate], native)
        self.shared_gate_linear = shared_gate

    def projections(self) -> list[tuple[Projection, list[nn.Linear]]]:
        out = [] if self.shared is None else self.shared.projections()
        if self.shared_gate is not None and self.shared_gate_linear is not None:
            out.append((self.shared_gate, [self.shared_gate_linear]))
        return out

    def __call__(
        self, x: torch.Tensor, adapter: Route | Spans | None, slots: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, hidden] normalised; slots [M] each row's adapter slot (None: all base)."""
        probs = torch.softmax(linear(x, self.router, None), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)  # pairs by expert, tokens in order within one
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token = order // self.top_k
        xs = x.index_select(0, token)
        h = _per_expert(self.gate_up, xs, counts)
        pair_slots = None if slots is None else slots.index_select(0, token)
        experts = flat.index_select(0, order)
        if pair_slots is not None:
            self.gate_up_lora.add(h, xs, pair_slots, experts)
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        y = _per_expert(self.down, h, counts)
        if pair_slots is not None:
            self.down_lora.add(y, h, pair_slots, experts)
        y.mul_(weights.reshape(-1).index_select(0, order).to(y.dtype)[:, None])
        out = torch.zeros_like(x).index_add_(0, token, y)
        if self.shared is not None:
            shared = self.shared(x, adapter, slots)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x, adapter)) * shared
            out = out + shared
        return out


def _per_expert(weights: list[torch.Tensor], x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows x [P, in] sorted by expert, counts[e] of them for expert e: each run through its
    expert's packed weight, one GEMM per expert hit."""
    out: torch.Tensor | None = None
    start = 0
    for expert, n in enumerate(counts):
        if not n:
            continue
        y = linear(x[start : start + n], weights[expert], None)
        if out is None:
            out = x.new_empty(x.shape[0], y.shape[1])
        out[start : start + n] = y
        start += n
    assert out is not None  # every pair has an expert
    return out


def _tensor(owner: nn.Module, name: str) -> torch.Tensor:
    """owner.name detached, checked to be a tensor."""
    value = getattr(owner, name)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{type(owner).__name__}.{name} is not a tensor")
    return value.detach()


def _standard_experts(module: nn.Module) -> bool:
    """transformers' fused expert layout: 3-D [gate; up] and down banks, not transposed, no
    bias (the layout the trainer adapts, `lorafleet_trainer.experts.is_standard_experts`)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and getattr(module, "is_transposed", False) is False
        and getattr(module, "has_bias", False) is False
        and getattr(module, "is_concatenated", True) is True
        and getattr(module, "has_gate", True) is True
        and getattr(module, "has_post_expert_norm", False) is False
    )


@dataclass
class Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Projection
    o: Projection
    mlp: Mlp | Moe
    #: Qwen3's per-head q and k RMSNorm weights, [heads + kv_heads, dim] (None: no norm).
    qk_norm: torch.Tensor | None


class SlotCache:
    """Keys and values of the decoding sequences: one buffer [layers, 2, slots, kv_heads,
    capacity, head], seen per layer as `keys[i]` and `values[i]` [slots, kv_heads, capacity,
    head] (contiguous views).

    Row i of the running batch lives in slot i; a finished row's slot is refilled by moving
    the last rows down (a copy of those rows only), and a step writes one column per row in
    place. One buffer means filling, moving or regrowing is one copy for every layer. Buffers
    grow (slots by doubling) zero-filled: masked columns must hold finite values, as
    0 * inf would poison the attention output; later they hold earlier rows' keys and
    values (a refilled slot, a buffer kept from the last batch), finite too.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        self.shape = (layers, kv_heads, head_dim)
        self.dtype = dtype
        self.store: torch.Tensor | None = None
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0

    def reserve(self, slots: int, capacity: int, used: int | None = None) -> None:
        """Room for `slots` rows of `capacity` columns. Live rows keep their first `used`
        columns (None: all); a regrowth sizes columns by that, not by the old capacity, so
        one long row that has since moved onto a shared segment does not size every slot."""
        if slots <= self.slots and capacity <= self.capacity:
            return
        new_slots = max(slots, 2 * self.slots if slots > self.slots else self.slots)
        kept = self.capacity if used is None else min(used, self.capacity)
        new_cap = max(capacity, kept)  # callers ask with spare columns
        layers, heads, dim = self.shape
        fresh = torch.zeros(layers, 2, new_slots, heads, new_cap, dim, dtype=self.dtype)
        if self.store is not None:
            fresh[:, :, : self.slots, :, :kept] = self.store[:, :, :, :, :kept]
        self._use(fresh)
        self.slots, self.capacity = new_slots, new_cap

    def _use(self, store: torch.Tensor | None) -> None:
        self.store = store
        self.keys = [] if store is None else list(store[:, 0].unbind())
        self.values = [] if store is None else list(store[:, 1].unbind())

    def fill(self, rows: slice, kv: torch.Tensor) -> None:
        """Copy one sequence's keys/values [layers, 2, kv_heads, length, head] into rows."""
        assert self.store is not None
        self.store[:, :, rows, :, : kv.shape[3]] = kv[:, :, None]

    def move(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Copy rows `src` onto rows `dst` (first `length` columns)."""
        assert self.store is not None
        self.store[:, :, dst, :, :length] = self.store[:, :, src, :, :length]

    def shift(self, row: int, columns: int, length: int) -> None:
        """Drop row's first `columns` columns of `length`: columns [columns, length) move to 0."""
        assert self.store is not None
        moved = self.store[:, :, row, :, columns:length].clone()
        self.store[:, :, row, :, : length - columns] = moved

    def clear(self) -> None:
        self._use(None)
        self.slots, self.capacity = 0, 0


class Segment:
    """Keys/values of a prompt prefix shared by several decoding rows (the samples of one
    request, or requests whose prompts share a cached prefix); per layer [kv_heads, length,
    dim]. Rows attend to it through `Decoder._merge`, their slots hold only what follows."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.layers = list(zip(keys, values, strict=True))
        self.length = keys[0].shape[1]


class Decoder:
    """The base model's weights in decode layout, the resident adapters, and the forward."""

    def __init__(self, model: PreTrainedModel, native: bool = True) -> None:
        cfg = model.config
        # to_dict writes the class's model_type; the instance's is what was loaded.
        why = torch_engine_refusal({**cfg.to_dict(), "model_type": cfg.model_type})
        if why is not None:
            raise InvalidArgument(why, field="model_path")
        rotary = model.model.rotary_emb
        attn = model.model.layers[0].self_attn
        self.heads: int = cfg.num_attention_heads
        self.kv_heads: int = cfg.num_key_value_heads
        self.head_dim: int = attn.head_dim
        self.scaling: float = attn.scaling
        self.eps: float = cfg.rms_norm_eps
        self.max_positions = int(cfg.max_position_embeddings)
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True):
            # A key further back than the window would be masked; within it, none is.
            self.max_positions = min(self.max_positions, int(window))
        self.embed = _detached_weight(model.get_input_embeddings())
        self.norm = model.model.norm.weight.detach()
        self.dtype = self.embed.dtype
        #: The C decode attention and LoRA (None: torch's), float32 only.
        self.native = kernels.load() if native and self.dtype == torch.float32 else None
        #: The shared-segment list last bound for `native.shared`, and its call.
        self._shared_bound: tuple[list, Callable[..., None]] | None = None
        lora_kernel = None if self.native is None else self.native.lora
        # The unembedding is a projection like the others: Tinker's train_unembed (on by
        # default in the SDK) puts LoRA on lm_head, and a sampler must apply it.
        head = model.get_output_embeddings()
        self.lm_head = Projection([head], lora_kernel)
        with torch.inference_mode():
            positions = torch.arange(self.max_positions)[None]
            cos, sin = rotary(self.embed[:1], positions)
        #: Columns of a head that rotate (Phi-3's partial rotary: the first ones), the rest pass.
        self.rotary_dim = int(cos.shape[-1])
        half = self.rotary_dim // 2
        self.cos = cos[0].contiguous()
        self.sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)  # see `_qkv`
        self.layers: list[Layer] = []
        #: PEFT target (module path, or "<experts module>.<bank>") -> (its LoRA stacks,
        #: index within the fused projection)
        self.targets: dict[str, tuple[Stacks, int]] = {}
        paths = {id(m): name for name, m in model.named_modules()}
        self.targets[paths[id(head)]] = (self.lm_head.lora, 0)
        #: Whether rows need their slot per token (`_row_slots`): expert LoRA is per pair.
        self.moe = False
        for layer in model.model.layers:
            attn = layer.self_attn
            qkv_linears = _fused(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
            qkv, o = Projection(qkv_linears, lora_kernel), Projection([attn.o_proj], lora_kernel)
            mlp: Mlp | Moe
            if hasattr(layer.mlp, "experts"):
                mlp = Moe(layer.mlp, cfg, lora_kernel)
                experts = paths[id(layer.mlp.experts)]
                self.targets[f"{experts}.gate_up_proj"] = (mlp.gate_up_lora, 0)
                self.targets[f"{experts}.down_proj"] = (mlp.down_lora, 0)
                self.moe = True
            else:
                mlp = Mlp(layer.mlp, lora_kernel)
            for projection, linears in [(qkv, qkv_linears), (o, [attn.o_proj]), *mlp.projections()]:
                for j, lin in enumerate(linears):
                    self.targets[paths[id(lin)]] = (projection.lora, j)
            self.layers.append(
                Layer(
                    layer.input_layernorm.weight.detach(),
                    layer.post_attention_layernorm.weight.detach(),
                    qkv,
                    o,
                    mlp,
                    qk_norm=self._qk_norm(attn),
                )
            )
        self.cache = SlotCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype)
        self._stacks = list(dict.fromkeys(stacks for stacks, _ in self.targets.values()))
        self._route_slots: tuple[Route, torch.Tensor] | None = None
        self.capacity = 1  # slots, slot 0 (the base model) included
        self.rank = 0
        self._slots: dict[str, int] = {}
        self._ranks: dict[str, int] = {}

    def _qk_norm(self, attn: nn.Module) -> torch.Tensor | None:
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None or k_norm is None:
            return None
        q, k = _detached_weight(q_norm), _detached_weight(k_norm)
        return torch.cat((q.expand(self.heads, -1), k.expand(self.kv_heads, -1)))

    # ------------------------------------------------------------------ adapters
    def check_targets(self, adapter: AdapterWeights) -> None:
        for module in adapter.modules:
            if module not in self.targets:
                raise InvalidArgument(
                    f"LoRA on {module} is not supported by the torch engine (only attention, "
                    "MLP, expert bank and lm_head projections)",
                    field="adapter_model.safetensors",
                )

    def slot(self, name: str | None) -> int:
        return 0 if name is None else self._slots[name]

    def __contains__(self, name: str | None) -> bool:
        return name is None or name in self._slots

    def lay_out(self, adapter: AdapterWeights) -> LaidOut:
        """The adapter's weights as whole slots of the stacks it targets, laid out at the
        rank the stacks will have once it is in. Reads only what is fixed after start-up
        (and the current rank, re-checked by `install`), so it runs off the decoding thread."""
        self.check_targets(adapter)
        parts: dict[Stacks, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, weights in adapter.modules.items():
            stacks, j = self.targets[module]
            parts.setdefault(stacks, {})[j] = weights
        rank = max(self.rank, adapter.rank)
        return LaidOut(adapter.rank, {s: s.lay_out(p, rank) for s, p in parts.items()})

    def install(self, name: str, adapter: LaidOut) -> None:
        """Put a laid-out adapter in a free slot: one copy per targeted stack, zeros only
        where the slot's previous tenant targeted a projection this one does not."""
        free = sorted(set(range(1, self.capacity + 1)) - set(self._slots.values()))
        slot = free[0]
        capacity = self.capacity if slot < self.capacity else max(4, 2 * self.capacity)
        self._reshape(capacity, max(self.rank, adapter.rank))
        for stacks in self._stacks:
            stacks.put(slot, adapter.stacks.get(stacks))
        self._slots[name] = slot
        self._ranks[name] = adapter.rank

    def remove(self, name: str) -> None:
        slot = self._slots.pop(name)
        del self._ranks[name]
        for stacks in self._stacks:
            stacks.release(slot)
        self._reshape(self.capacity, max(self._ranks.values(), default=0))

    def _reshape(self, capacity: int, rank: int) -> None:
        if (capacity, rank) == (self.capacity, self.rank):
            return
        self.capacity, self.rank = capacity, rank
        for stacks in self._stacks:
            stacks.resize(capacity, rank)

    # ------------------------------------------------------------------ forward
    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, weight.shape, weight, self.eps)

    def _rotary(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [M, 1, dim] for positions pos [M], looked up once per forward."""
        return self.cos[pos][:, None], self.sin[pos][:, None]

    def _qkv(
        self,
        layer: Layer,
        x: torch.Tensor,
        adapter: Route | Spans | None,
        rotary: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [M, heads, dim], k and v [M, kv_heads, dim] for rows x (rotary from `_rotary`)."""
        qkv = layer.qkv(self._rms(x, layer.ln1), adapter)
        heads, dim = self.heads + self.kv_heads, self.head_dim
        qk = qkv[:, : heads * dim].view(-1, heads, dim)  # q and k heads, rotated together
        v = qkv[:, heads * dim :].view(-1, self.kv_heads, dim)
        if layer.qk_norm is not None:
            qk = F.rms_norm(qk, (dim,), None, self.eps).mul_(layer.qk_norm)
        cos, sin = rotary
        # rotate_half(x) * sin == roll(x, dim / 2) * (sin with its first half negated)
        rot = self.rotary_dim
        if rot == dim:
            qk = torch.addcmul(qk * cos, qk.roll(dim // 2, -1), sin)
        else:  # partial rotary: the first `rot` columns turn, the others pass unchanged
            part = qk[..., :rot]
            turned = torch.addcmul(part * cos, part.roll(rot // 2, -1), sin)
            qk = torch.cat((turned, qk[..., rot:]), dim=-1)
        return qk[:, : self.heads], qk[:, self.heads :], v

    def _rest(
        self,
        layer: Layer,
        x: torch.Tensor,
        attn: torch.Tensor,
        adapter: Route | Spans | None,
        slots: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + layer.o(attn, adapter)
        return x + layer.mlp(self._rms(x, layer.ln2), adapter, slots)

    def _row_slots(self, adapter: Route | Spans | None, rows: int) -> torch.Tensor | None:
        """Each row's adapter slot [rows] (0 = base), for the expert banks' per-pair LoRA;
        None when the model has no experts or no row uses an adapter. A decode route's is
        made once per route, not per step."""
        if not self.moe or not adapter:
            return None
        if isinstance(adapter, Route):
            if self._route_slots is None or self._route_slots[0] is not adapter:
                slots = torch.zeros(rows, dtype=torch.long)
                slots[adapter.order.long()] = adapter.order_slots.long()
                self._route_slots = (adapter, slots)
            return self._route_slots[1]
        slots = torch.zeros(rows, dtype=torch.long)
        for first, last, slot in adapter:
            slots[first:last] = slot
        return slots

    def logits(self, x: torch.Tensor, adapter: Route | Spans | None = None) -> torch.Tensor:
        """Logits of hidden states x, with the rows' lm_head LoRA (if their adapter has one)."""
        return self.lm_head(self._rms(x, self.norm), adapter)

    def prefill(self, parts: list[PrefillPart]) -> torch.Tensor:
        """Run the parts (chunks of several prompts) as one batch: every projection is one
        GEMM over all their tokens, attention runs per part. Returns the final hidden states
        [sum of part lengths, hidden], part after part."""
        group = self.heads // self.kv_heads
        bounds: list[tuple[int, int]] = []
        masks: list[torch.Tensor] = []
        spans: Spans = []
        for part in parts:
            first = bounds[-1][1] if bounds else 0
            bounds.append((first, first + len(part.tokens)))
            end = part.start + len(part.tokens)
            pos = torch.arange(part.start, end)
            # [group * T, end]: the query heads sharing a kv head, one after another.
            masks.append((torch.arange(end)[None, :] <= pos[:, None]).repeat(group, 1))
            if part.slot:
                spans.append((first, first + len(part.tokens), part.slot))
        x = self.embed[torch.cat([p.tokens for p in parts])]
        slots = self._row_slots(spans, x.shape[0])
        rotary = self._rotary(
            torch.cat([torch.arange(p.start, p.start + len(p.tokens)) for p in parts])
        )
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, spans, rotary)
            outs = []
            for part, (first, last), mask in zip(parts, bounds, masks, strict=True):
                length, end = last - first, part.start + last - first
                k_store, v_store = part.keys[i], part.values[i]
                k_store[:, part.start : end] = k[first:last].transpose(0, 1)
                v_store[:, part.start : end] = v[first:last].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    q[first:last].transpose(0, 1).reshape(self.kv_heads, -1, self.head_dim),
                    k_store[:, :end],
                    v_store[:, :end],
                    attn_mask=mask,
                    scale=self.scaling,
                )
                outs.append(out.view(self.heads, length, -1).transpose(0, 1).reshape(length, -1))
            x = self._rest(layer, x, torch.cat(outs), spans, slots)
        return x

    def decode(
        self,
        tokens: torch.Tensor,
        pos: torch.Tensor,
        cols: torch.Tensor,
        length: int,
        route: Route | None,
        shared: list[tuple[Segment, torch.Tensor]],
    ) -> torch.Tensor:
        """One step for the rows of the slot cache: tokens [B] at positions pos [B], written
        to slot columns cols [B] (pos minus the row's shared segment length); `length` =
        max(cols) + 1; `shared` lists each segment with the rows [n] attending to it.
        Returns logits [B, vocab]."""
        rows = tokens.shape[0]
        cache = self.cache
        index = torch.arange(rows)
        if self.native is not None:
            lengths, hidden = (cols + 1).to(torch.int32), None
            longest = int(cols.max()) + 1
        else:  # columns past a row's own end (None when every row fills all of `length`)
            beyond = torch.arange(length)[None, :] > cols[:, None]
            hidden = beyond[:, None, None, :] if bool(beyond.any()) else None
        merge = self._shared_call(shared) if shared and self.native is not None else None
        if not shared:
            self._shared_bound = None  # holds the last batch's segments: let them go
        x = self.embed[tokens]
        slots = self._row_slots(route, rows)
        rotary = self._rotary(pos)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, route, rotary)
            k_store, v_store = cache.keys[i], cache.values[i]
            q = q.view(rows, self.kv_heads, -1, self.head_dim)
            if self.native is not None:
                q = q.contiguous()
                own = self.native.attention(
                    q, k, v, k_store, v_store, lengths, longest, self.scaling
                )
            else:
                k_store[index, :, cols] = k
                v_store[index, :, cols] = v
                own = self._attend(
                    q, k_store[:rows, :, :length], v_store[:rows, :, :length], hidden
                )
            if merge is not None:
                merge(i, q, *own)
                out = own[0]
            elif shared:
                out = self._merge(q, *own, [(seg.layers[i], r) for seg, r in shared])
            else:
                out = own[0]
            x = self._rest(layer, x, out.reshape(rows, -1), route, slots)
        return self.logits(x, route)

    def _shared_call(self, shared: list[tuple[Segment, torch.Tensor]]) -> Callable[..., None]:
        """The native merge over `shared`'s segments, bound once per list: the engine builds a
        new list whenever its rows change, so the same list means the same segments and rows."""
        if self._shared_bound is None or self._shared_bound[0] is not shared:
            assert self.native is not None
            call = self.native.shared.bind(
                [(seg.layers, rows) for seg, rows in shared],
                self.kv_heads, self.heads // self.kv_heads, self.head_dim, self.scaling,
            )  # fmt: skip
            self._shared_bound = (shared, call)
        return self._shared_bound[1]

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Torch's version of the native kernel (`kernels.DecodeAttention`, same results and
        returns), for machines without a C compiler: batched matmuls over the longest row's
        columns, `hidden` masking those past each row's end. Not scaled_dot_product_attention:
        for one query row its CPU flash kernel took ~0.9 ms a layer at 16 rows x 100 columns
        (profiled), where these matmuls took ~0.3 ms."""
        scores = (q @ keys.transpose(-1, -2)).mul_(self.scaling)
        if hidden is not None:
            scores.masked_fill_(hidden, -math.inf)
        peak = scores.amax(-1, keepdim=True)  # finite: the current token is always own
        weights = (scores - peak).exp_()
        total = weights.sum(-1, keepdim=True)
        return (weights @ values).div_(total), peak, total

    def _merge(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        peak: torch.Tensor,
        total: torch.Tensor,
        shared: list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]],
    ) -> torch.Tensor:
        """Add attention over shared segments to rows' own (`out`, normalised, with its `peak`
        and `total`), merged exactly (log-sum-exp): a segment's keys/values are read once
        for all its rows, never copied per row. q [B, kv_heads, group, dim]; returns
        [B, kv_heads, group, dim]."""
        out = out * total
        for (keys, values), rows in shared:
            n, heads, group, dim = rows.shape[0], q.shape[1], q.shape[2], q.shape[3]
            # [kv_heads, n * group, dim]: every row's query heads against one copy of the keys
            sq = q.index_select(0, rows).permute(1, 0, 2, 3).reshape(heads, n * group, dim)
            s = (sq @ keys.transpose(-1, -2)).mul_(self.scaling)
            s_peak = s.amax(-1, keepdim=True)
            w = (s - s_peak).exp_()
            s_total = w.sum(-1, keepdim=True)
            s_out = w @ values

            s_peak, s_total, s_out = (
                t.view(heads, n, group, -1).permute(1, 0, 2, 3) for t in (s_peak, s_total, s_out)
            )
            r_peak = peak.index_select(0, rows)
            top = torch.maximum(r_peak, s_peak)
            mine, theirs = (r_peak - top).exp_(), (s_peak - top).exp_()
            peak.index_copy_(0, rows, top)
            total.index_copy_(0, rows, total.index_select(0, rows) * mine + s_total * theirs)
            out.index_copy_(0, rows, out.index_select(0, rows) * mine + s_out * theirs)
        return out / total


def _detached_weight(module: nn.Module) -> torch.Tensor:
    """A module's weight for the decode layout; checked, as nn.Module attributes are untyped."""
    weight = module.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__}.weight is not a tensor")
    return weight.detach()
