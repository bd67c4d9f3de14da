"""Grouped LoRA (`lora.py`) against PEFT row by row, and the in-place KV buffers of `kvbatch.py`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from rollout_helpers import load_base, make_adapter, reference_model
from transformers import DynamicCache

from lorafleet.errors import InvalidArgument
from lorafleet_rollout.kvbatch import new_cache
from lorafleet_rollout.lora import LoraBank, adapter_weights
from lorafleet_rollout.peft_io import WEIGHTS_FILE, check_fits, linear_shapes, read_peft_dir

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def peft_folder(model_dir: Path, out: Path, seed: int, **config) -> Path:
    torch.manual_seed(seed)
    model = get_peft_model(load_base(model_dir), LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("adapters")
    return {
        "a": make_adapter(model_dir, tmp / "a", seed=1, rank=4),
        "b": peft_folder(
            model_dir, tmp / "b", 2, r=8, lora_alpha=5, target_modules=list(ALL), use_rslora=True
        ),
        "c": peft_folder(
            model_dir,
            tmp / "c",
            3,
            r=2,
            lora_alpha=4,
            target_modules=["q_proj", "v_proj"],
            alpha_pattern={"v_proj": 7.0},
        ),
        "d": make_adapter(model_dir, tmp / "d", seed=4, rank=4, targets=("o_proj", "up_proj")),
    }


def install(bank: LoraBank, linears: dict[str, tuple[int, int]], name: str, folder: Path) -> None:
    config, tensors = read_peft_dir(folder)
    check_fits(tensors, config, linears, 64)
    bank.install(name, adapter_weights(config, tensors))


def check_rows(
    bank: LoraBank, model_dir: Path, folders: dict[str, Path], rows: list[str | None]
) -> None:
    """One mixed forward equals, row by row, PEFT with that row's adapter alone."""
    torch.manual_seed(0)
    ids = torch.randint(3, 300, (len(rows), 7))
    with torch.inference_mode():
        bank.active = bank.route(["__base__" if r is None else r for r in rows])
        try:
            mixed = torch.log_softmax(bank.model(input_ids=ids).logits, dim=-1)
        finally:
            bank.active = None
        for i, name in enumerate(rows):
            ref = reference_model(model_dir, None if name is None else folders[name])
            alone = torch.log_softmax(ref(input_ids=ids[i : i + 1]).logits[0], dim=-1)
            assert (mixed[i] - alone).abs().max() <= 1e-4, name


def test_mixed_ranks_targets_and_scalings_match_peft(
    model_dir: Path, folders: dict[str, Path]
) -> None:
    model = load_base(model_dir)
    linears = linear_shapes(model)  # of the unwrapped base, as the engine keeps it
    bank = LoraBank(model)
    with torch.inference_mode():
        for name in ("a", "b", "c"):
            install(bank, linears, name, folders[name])
    # Uneven groups: "a" spans two chunks, the others are padded, one row is the base model.
    check_rows(bank, model_dir, folders, ["a", "b", "a", None, "c", "a"])
    check_rows(bank, model_dir, folders, ["c"])

    with torch.inference_mode():
        bank.remove("b")  # the largest rank leaves: stacks shrink back to rank 4
        assert bank.rank == 4
        install(bank, linears, "d", folders["d"])  # reuses b's slot, which must now be clean
    check_rows(bank, model_dir, folders, ["d", "a", "c", "d"])
    with torch.inference_mode():
        for name in ("a", "c", "d"):
            bank.remove(name)
    check_rows(bank, model_dir, folders, [None, None])


def test_weights_cached_per_route_follow_writes_to_its_slots(
    model_dir: Path, folders: dict[str, Path]
) -> None:
    model = load_base(model_dir)
    linears = linear_shapes(model)
    bank = LoraBank(model)
    ids = torch.randint(3, 300, (2, 5), generator=torch.Generator().manual_seed(1))

    def run(route) -> torch.Tensor:
        bank.active = route
        try:
            return torch.log_softmax(model(input_ids=ids).logits, dim=-1)
        finally:
            bank.active = None

    with torch.inference_mode():
        install(bank, linears, "a", folders["a"])
        install(bank, linears, "c", folders["c"])
        route = bank.route(["a", "c"])
        first = run(route)
        install(bank, linears, "b", folders["b"])  # another slot: the cached weights stay right
        assert torch.equal(run(route), first)
        bank.remove("c")
        install(bank, linears, "d", folders["d"])  # lands in c's slot, which `route` names
        changed = run(route)
        ref = reference_model(model_dir, folders["d"])
        alone = torch.log_softmax(ref(input_ids=ids[1:]).logits[0], dim=-1)
    assert (changed[1] - alone).abs().max() <= 1e-4
    assert (changed[0] - first[0]).abs().max() <= 1e-6


def test_bad_pairs_and_ranks_are_refused(model_dir: Path, folders: dict[str, Path]) -> None:
    config, tensors = read_peft_dir(folders["a"])
    lonely = {k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj.lora_B" not in k}
    with pytest.raises(InvalidArgument) as missing:
        adapter_weights(config, lonely)
    assert missing.value.field == WEIGHTS_FILE and "q_proj" in str(missing.value)

    config.rank_pattern = {"v_proj": 2}
    with pytest.raises(InvalidArgument) as rank:
        adapter_weights(config, tensors)
    assert "configured rank 2" in str(rank.value)


def test_slab_layer_writes_in_place_and_equals_concatenation() -> None:
    torch.manual_seed(0)
    slab, plain = new_cache(), DynamicCache()
    prompt = torch.randn(2, 3, 5, 8)
    slab.update(prompt, -prompt, 0)
    plain.update(prompt, -prompt, 0)
    buffers = set()
    for _ in range(100):
        step = torch.randn(2, 3, 1, 8)
        keys, values = slab.update(step, step * 2, 0)
        ref_keys, ref_values = plain.update(step, step * 2, 0)
        assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
        buffers.add(keys.untyped_storage().data_ptr())
    assert len(buffers) <= 5  # 5 -> 105 columns by doubling, not one copy per token
