"""Run inside .venvs/sglang: SGLang 0.5.23's own adapter-loading code on one adapter folder.

    python sglang_loader_check.py ADAPTER MODEL OUT TARGETS MAX_RANK

What the server's tokenizer/scheduler would do with `/load_lora_adapter` and the first batch,
without starting a server: `LoRAConfig`, the memory pool's `can_support` rule,
`LoRAAdapter.initialize_weights_from_tensors` (key processing and q/k/v, gate/up
normalisation), then `get_target_module_name` for every weight, as
`LoRAMemoryPool.load_lora_weight_to_buffer` does before it copies (a weight that maps to no
module is what kills the scheduler), and the `_moe` buffer each per-expert weight goes to.
Prints one JSON line; writes the normalised per-layer weights to OUT (safetensors).
"""

from __future__ import annotations

import json
import re
import sys

from safetensors.torch import load_file, save_file
from sglang.srt.lora.lora import LoRAAdapter, LoRALayer
from sglang.srt.lora.lora_config import LoRAConfig
from sglang.srt.lora.utils import get_normalized_target_modules, get_target_module_name
from torch import nn
from transformers import AutoConfig


def main() -> None:
    adapter, model, out, targets, max_rank = sys.argv[1:6]
    base = AutoConfig.from_pretrained(model)
    config = LoRAConfig(adapter, base_vocab_size=base.vocab_size)
    server = get_normalized_target_modules(targets.split(","))
    wanted = get_normalized_target_modules(config.target_modules)
    supported = config.r <= int(max_rank) and ("all" in wanted or wanted <= server)
    report: dict = {"supported": supported}
    lora = LoRAAdapter.__new__(LoRAAdapter)
    nn.Module.__init__(lora)
    lora.uid, lora.config, lora.base_hf_config = "check", config, base
    object.__setattr__(lora, "_moe_is_gated_by_layer", {})
    lora.layers = nn.ModuleList(LoRALayer(config, base) for _ in range(base.num_hidden_layers))
    lora.embedding_layers, lora.added_tokens_embeddings = {}, {}
    try:
        lora.initialize_weights_from_tensors(load_file(f"{adapter}/adapter_model.safetensors"))
    except Exception as exc:  # what /load_lora_adapter would answer
        report["load_error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(report))
        return
    weights = {n: w for layer in lora.layers for n, w in layer.weights.items()}
    names = [*weights, *lora.embedding_layers]
    unmapped, buffers = [], {}
    for name in names:
        try:
            module = get_target_module_name(name, server)
        except ValueError:
            unmapped.append(name)
            continue
        if re.search(r"experts\.(\d+)\.", name):
            module += "_moe"
        buffers[name] = module
    report |= {"unmapped": sorted(unmapped), "buffers": buffers}
    save_file({n: w.contiguous() for n, w in weights.items()}, out)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
