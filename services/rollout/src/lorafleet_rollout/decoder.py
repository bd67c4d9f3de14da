"""The torch engine's forward pass: a Llama-family decoder written for CPU decoding.

Why not transformers' forward: decode is bound by the bytes it streams (every weight once per
step, every row's keys/values) and, at a few dozen rows, by the Python-level ops around them.
Here the weights are packed once (`projection.pack`, oneDNN's layout), q/k/v and gate/up are
fused into one GEMM each, q and k are rotated together from precomputed tables, the KV cache
is a set of per-sequence slots written in place (`kv_cache.SlotCache`), decode attention is
one native call per layer that writes the step's keys/values and reads each row's own columns
once (`kernels.py`; `attention.attend` in torch), each projection's LoRA is one native call
over the rows grouped by adapter (`lora.py`), and prompt prefixes that several rows share are
read once per step for all of them (`kv_cache.Segment`: one native call per layer over every
segment, `kernels.DecodeShared`; or `attention.merge_shared` in torch).

Where a decode step goes (bench model, 16 rows x ~100 columns, one thread, profiled): ~65 %
the projection GEMMs (oneDNN at 16 rows: ~46 GFLOP/s, streaming 84 MB of weights from DRAM
without overlapping compute), ~8 % attention, the rest elementwise ops and Python.

The arithmetic is transformers' (the same RMSNorm, rotate-half rotary from the model's own
rotary module, so rope scaling variants match, partial rotary too, softmax attention with the
same scaling); tests hold logprobs to 1e-4 of transformers + PEFT. The families served are
`lorafleet.families`' rule (the one `lorafleet up` checks): Llama, Mistral, Qwen2, Qwen3,
Phi-3 (fused `qkv_proj` and `gate_up_proj`: one Projection each, its LoRA PEFT's on the
fused output), and the Qwen MoEs (`moe.Moe`: top-k routing, per-expert LoRA, Qwen2-MoE's gated
shared expert). A sliding window caps the context at the window instead: every key is then
inside it, so attention is exact without a windowed mask.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lorafleet.errors import InvalidArgument
from lorafleet.families import torch_engine_refusal
from lorafleet_rollout import kernels
from lorafleet_rollout.adapter_slots import AdapterSlots, Stacks
from lorafleet_rollout.attention import attend, merge_shared, prompt_attention
from lorafleet_rollout.kv_cache import Segment, SlotCache
from lorafleet_rollout.lora import Route
from lorafleet_rollout.moe import Moe
from lorafleet_rollout.projection import (
    Mlp,
    Projection,
    Spans,
    detached_weight,
    fused_linears,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class PrefillPart:
    """Prompt tokens [T] at positions start.. of one sequence whose first `start` keys and
    values are in keys/values (per layer [kv_heads, >= start + T, dim], written in place);
    `outputs`: how many of its last positions' final hidden states the caller reads (0 to T:
    1 for a prompt's last token, T for prompt logprobs)."""

    tokens: torch.Tensor
    start: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    slot: int
    outputs: int


@dataclass
class Layer:
    ln1: torch.Tensor
    ln2: torch.Tensor
    qkv: Projection
    o: Projection
    mlp: Mlp | Moe
    #: Qwen3's per-head q and k RMSNorm weights, [heads + kv_heads, dim] (None: no norm).
    qk_norm: torch.Tensor | None


class Decoder(AdapterSlots):
    """The base model's weights in decode layout and the forward; the resident adapters'
    slots are `AdapterSlots`'."""

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
        self.embed = detached_weight(model.get_input_embeddings())
        self.norm = model.model.norm.weight.detach()
        self.dtype = self.embed.dtype
        #: The C decode attention and LoRA (None: torch's), float32 only.
        self.native = kernels.load() if native and self.dtype == torch.float32 else None
        #: The shared-segment list last bound for `native.shared`, and its call.
        self._shared_bound: (
            tuple[list[tuple[Segment, torch.Tensor]], Callable[..., None]] | None
        ) = None
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
        # PEFT target (module path, or "<experts module>.<bank>") -> (its LoRA stacks,
        # index within the fused projection)
        targets: dict[str, tuple[Stacks, int]] = {}
        paths = {id(m): name for name, m in model.named_modules()}
        targets[paths[id(head)]] = (self.lm_head.lora, 0)
        #: Whether rows need their slot per token (`_row_slots`): expert LoRA is per pair.
        self.moe = False
        for layer in model.model.layers:
            attn = layer.self_attn
            qkv_linears = fused_linears(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
            qkv, o = Projection(qkv_linears, lora_kernel), Projection([attn.o_proj], lora_kernel)
            mlp: Mlp | Moe
            if hasattr(layer.mlp, "experts"):
                mlp = Moe(layer.mlp, cfg, lora_kernel)
                experts = paths[id(layer.mlp.experts)]
                targets[f"{experts}.gate_up_proj"] = (mlp.gate_up_lora, 0)
                targets[f"{experts}.down_proj"] = (mlp.down_lora, 0)
                self.moe = True
            else:
                mlp = Mlp(layer.mlp, lora_kernel)
            for projection, linears in [(qkv, qkv_linears), (o, [attn.o_proj]), *mlp.projections()]:
                for j, lin in enumerate(linears):
                    targets[paths[id(lin)]] = (projection.lora, j)
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
        super().__init__(targets)

    def _qk_norm(self, attn: nn.Module) -> torch.Tensor | None:
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None or k_norm is None:
            return None
        q, k = detached_weight(q_norm), detached_weight(k_norm)
        return torch.cat((q.expand(self.heads, -1), k.expand(self.kv_heads, -1)))

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
        None when the model has no experts or no row uses an adapter. A decode route carries
        its own (`Route.row_slots`), made once per route, not per step."""
        if not self.moe or not adapter:
            return None
        if isinstance(adapter, Route):
            return adapter.row_slots
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
        of each part's last `outputs` positions [sum of outputs, hidden], part after part.

        The last layer computes every position's keys and values but the rest (attention,
        output projection, MLP) only for the positions whose outputs are read: a prompt's
        other positions are never read past that layer (a cold 1,500-token prompt on the
        bench model: ~13 % of its prefill)."""
        bounds: list[tuple[int, int]] = []
        spans: Spans = []
        for part in parts:
            if not 0 <= part.outputs <= len(part.tokens):
                raise ValueError(f"outputs {part.outputs} of a {len(part.tokens)}-token part")
            first = bounds[-1][1] if bounds else 0
            bounds.append((first, first + len(part.tokens)))
            if part.slot:
                spans.append((first, first + len(part.tokens), part.slot))
        x = self.embed[torch.cat([p.tokens for p in parts])]
        slots = self._row_slots(spans, x.shape[0])
        rotary = self._rotary(
            torch.cat([torch.arange(p.start, p.start + len(p.tokens)) for p in parts])
        )
        final = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, spans, rotary)
            outs = []
            kept: list[tuple[int, int, int]] = []  # (first, last, slot) of the rows kept
            for part, (first, last) in zip(parts, bounds, strict=True):
                end = part.start + last - first
                k_store, v_store = part.keys[i], part.values[i]
                k_store[:, part.start : end] = k[first:last].transpose(0, 1)
                v_store[:, part.start : end] = v[first:last].transpose(0, 1)
                skip = last - first - part.outputs if i == final else 0
                if first + skip < last:
                    kept.append((first + skip, last, part.slot))
                    outs.append(
                        prompt_attention(
                            q[first + skip : last],
                            k_store,
                            v_store,
                            part.start + skip,
                            self.scaling,
                        )
                    )
            if i == final:
                x, spans, slots = self._keep(x, kept, slots)
                if not outs:
                    return x
            x = self._rest(layer, x, torch.cat(outs), spans, slots)
        return x

    @staticmethod
    def _keep(
        x: torch.Tensor, kept: list[tuple[int, int, int]], slots: torch.Tensor | None
    ) -> tuple[torch.Tensor, Spans, torch.Tensor | None]:
        """Rows `kept` ((first, last, slot) ranges) of x and of the row slots, with the spans
        of the rows kept (renumbered)."""
        index = torch.cat(
            [torch.arange(first, last) for first, last, _ in kept]
            or [torch.empty(0, dtype=torch.long)]
        )
        spans: Spans = []
        at = 0
        for first, last, slot in kept:
            if slot:
                spans.append((at, at + last - first, slot))
            at += last - first
        return x[index], spans, None if slots is None else slots[index]

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
                own = attend(
                    q, k_store[:rows, :, :length], v_store[:rows, :, :length], hidden, self.scaling
                )
            if merge is not None:
                merge(i, q, *own)
                out = own[0]
            elif shared:
                out = merge_shared(q, *own, [(seg.layers[i], r) for seg, r in shared], self.scaling)
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
                self.kv_heads,
                self.heads // self.kv_heads,
                self.head_dim,
                self.scaling,
            )
            self._shared_bound = (shared, call)
        return self._shared_bound[1]
