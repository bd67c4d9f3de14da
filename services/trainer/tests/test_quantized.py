"""The quantized frozen base: a quarter of the memory, and exact training on its weights.

The reference is PEFT on a float model whose weights were replaced by the dequantized ones
(`lorafleet.quantize.dequantize_in_place`, what the rollout's CPU engine serves): the
trainer, holding only codes, must give that model's logprobs and LoRA gradients.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lorafleet import quantize
from lorafleet_trainer.domain import ForwardBackwardInput, ForwardBackwardItem, LoraSpec
from lorafleet_trainer.engine import TrainerEngine
from lorafleet_trainer.quantized import QuantizedEmbedding, QuantizedLinear, base_nbytes

from .conftest import Helpers, build_random_llama
from .test_exactness import SPECS, assert_close, make_datum, reference


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama with tied embeddings (as SmolLM2 and the tiny model are)."""
    from transformers import AutoModelForCausalLM

    folder = build_random_llama(tmp_path_factory.mktemp("m") / "untied", hidden=128, vocab=512)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    out = tmp_path_factory.mktemp("m") / "tied"
    model.save_pretrained(out)
    return out


def _engine(folder: Path, tmp_path: Path, kind: str) -> TrainerEngine:
    return TrainerEngine.from_pretrained(
        folder,
        device="cpu",
        dtype="float32",
        num_slots=4,
        max_rank=16,
        storage_root=tmp_path / "states",
        quantization=kind,
    )


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_base_memory_is_under_a_third_of_float32(tied_dir: Path, tmp_path: Path, kind) -> None:
    full = base_nbytes(_engine(tied_dir, tmp_path, "none").model)
    engine = _engine(tied_dir, tmp_path, kind)
    ratio = base_nbytes(engine.model) / full
    assert ratio <= 0.3, ratio
    mods = list(engine.model.modules())
    assert not any(isinstance(m, torch.nn.Linear | torch.nn.Embedding) for m in mods)
    emb = next(m for m in mods if isinstance(m, QuantizedEmbedding))
    head = engine.wrappers["lm_head"].base
    assert isinstance(head, QuantizedLinear)
    assert head.codes.data_ptr() == emb.codes.data_ptr()  # tied: one set of codes
    assert engine.info()["quantization"] == kind


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling"])
def test_training_on_codes_matches_peft_on_the_dequantized_base(
    model_dir: Path, tmp_path: Path, kind: str, loss_fn: str
) -> None:
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    quantize.dequantize_in_place(ref_model, kind)
    ref_model.save_pretrained(tmp_path / "dequantized")
    h = Helpers(tmp_path / "dequantized")

    engine = _engine(model_dir, tmp_path, kind)
    for slot, spec in enumerate(SPECS):
        engine.bind(slot, f"r{slot}", spec)
        h.perturb(engine, slot, seed=100 + slot)
    gen = torch.Generator().manual_seed(7)
    data = {s: [make_datum(gen, n, loss_fn) for n in (5, 9, 4)] for s in (0, 1)}
    items = [
        ForwardBackwardItem(f"op{s}", s, f"r{s}", ForwardBackwardInput(data[s], loss_fn, {}))
        for s in (1, 0)
    ]
    for item, out in zip(items, engine.forward_backward(items), strict=True):
        s = item.slot
        ref_lp, ref_grads = reference(h, engine, s, [data[s]], loss_fn, {})
        for got, want in zip(out.logprobs, ref_lp, strict=True):
            assert_close(got, want)
        grads = h.slot_grads(engine, s)
        assert grads.keys() == ref_grads.keys()
        for key in grads:
            assert_close(grads[key], ref_grads[key])
        binding = engine.slots.bindings[s]
        for name in binding.targets:  # LoRA stays float32 and trainable
            assert binding.a[name].dtype == binding.b[name].dtype == torch.float32


def test_a_quantized_base_differs_from_float_but_only_by_rounding(
    model_dir: Path, tmp_path: Path
) -> None:
    """The codes are really used (logprobs move), and they are a faithful base (a little)."""
    spec = LoraSpec(rank=4, seed=3)
    datum = make_datum(torch.Generator().manual_seed(1), 12, "cross_entropy")
    lps = {}
    for kind in ("none", "int8"):
        engine = _engine(model_dir, tmp_path, kind)
        engine.bind(0, "r", spec)
        item = ForwardBackwardItem("op", 0, "r", ForwardBackwardInput([datum], "cross_entropy"))
        (out,) = engine.forward_backward([item])
        lps[kind] = out.logprobs[0]
    diff = (lps["none"] - lps["int8"]).abs().max().item()
    assert 0 < diff < 0.05, diff
