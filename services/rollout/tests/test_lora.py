"""The decoder and its grouped LoRA against transformers + PEFT row by row; the slot cache."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from rollout_helpers import load_base, make_adapter, reference_model

from lorafleet.errors import InvalidArgument
from lorafleet_rollout.decoder import Decoder, PrefillPart
from lorafleet_rollout.kv_cache import Segment, SlotCache
from lorafleet_rollout.lora import AdapterWeights, LoraStacks, adapter_weights, make_route
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
        "big": make_adapter(model_dir, tmp / "big", seed=5, rank=64, targets=ALL, scale=0.3),
    }


def install(dec: Decoder, linears: dict[str, tuple[int, int]], name: str, folder: Path) -> None:
    config, tensors = read_peft_dir(folder)
    check_fits(tensors, config, linears, 64)
    dec.install(name, dec.lay_out(adapter_weights(config, tensors)))


def mixed_logprobs(
    dec: Decoder, rows: list[str | None], ids: torch.Tensor, shared: int = 0
) -> torch.Tensor:
    """Log-softmax [R, T, V] of every position: each row prefilled alone through its adapter
    (all but the last token), then one routed decode step over all rows together. With
    `shared`, rows 0 and 1 attend to one `Segment` holding row 0's first `shared` positions
    and keep only the rest in their slots."""
    count, length = ids.shape
    prefilled = []
    dec.cache.reserve(count, length)
    segment = None
    for r, name in enumerate(rows):
        shape = (dec.kv_heads, length - 1, dec.head_dim)
        keys = [torch.zeros(shape) for _ in dec.layers]
        values = [torch.zeros(shape) for _ in dec.layers]
        prompt = ids[r, :-1]
        hidden = dec.prefill([PrefillPart(prompt, 0, keys, values, dec.slot(name), len(prompt))])
        prefilled.append(dec.logits(hidden))
        base = shared if r < 2 else 0
        if r == 0 and shared:
            segment = Segment([k[:, :shared] for k in keys], [v[:, :shared] for v in values])
        kv = torch.stack(
            [torch.stack([k[:, base:], v[:, base:]]) for k, v in zip(keys, values, strict=True)]
        )
        dec.cache.fill(slice(r, r + 1), kv)
    route = make_route([dec.slot(name) for name in rows])
    pos = torch.full((count,), length - 1)
    cols = pos - torch.tensor([shared if r < 2 else 0 for r in range(count)])
    groups = [] if segment is None else [(segment, torch.tensor([0, 1]))]
    last = dec.decode(ids[:, -1], pos, cols, int(cols.max()) + 1, route, groups)
    dec.cache.clear()
    return torch.log_softmax(torch.cat([torch.stack(prefilled), last[:, None]], dim=1), dim=-1)


def check_rows(
    dec: Decoder,
    model_dir: Path,
    folders: dict[str, Path],
    rows: list[str | None],
    shared: int = 0,
) -> None:
    """Prefill and a mixed decode step equal, row by row, PEFT with that row's adapter alone."""
    ids = torch.randint(3, 300, (len(rows), 7), generator=torch.Generator().manual_seed(0))
    if shared:
        ids[1, :shared] = ids[0, :shared]
    with torch.inference_mode():
        mixed = mixed_logprobs(dec, rows, ids, shared)
        for i, name in enumerate(rows):
            ref = reference_model(model_dir, None if name is None else folders[name])
            alone = torch.log_softmax(ref(input_ids=ids[i : i + 1]).logits[0], dim=-1)
            assert (mixed[i] - alone).abs().max() <= 1e-4, name


def test_mixed_ranks_targets_and_scalings_match_peft(
    model_dir: Path, folders: dict[str, Path]
) -> None:
    model = load_base(model_dir)
    linears = linear_shapes(model)  # of the unwrapped base, as the engine keeps it
    dec = Decoder(model)
    with torch.inference_mode():
        for name in ("a", "b", "c"):
            install(dec, linears, name, folders[name])
    # Uneven groups: "a" spans two chunks, the others are padded, one row is the base model.
    check_rows(dec, model_dir, folders, ["a", "b", "a", None, "c", "a"])
    check_rows(dec, model_dir, folders, ["c"])
    # Rows 0 and 1 read their first 4 positions from one shared segment (cascade attention).
    check_rows(dec, model_dir, folders, ["a", "a", "c", None], shared=4)

    with torch.inference_mode():
        dec.remove("b")  # the only rank-8 adapter leaves: its class's stacks go
        assert dec.capacity == {4: 2}
        dec.remove("a")
        install(dec, linears, "d", folders["d"])  # reuses a's slot, which must now be clean
        install(dec, linears, "a", folders["a"])  # its class grows
        assert dec.capacity == {4: 3}  # by a quarter, at least one
    check_rows(dec, model_dir, folders, ["d", "a", "c", "d"])
    with torch.inference_mode():
        for name in ("a", "c", "d"):
            dec.remove(name)
    check_rows(dec, model_dir, folders, [None, None])


def test_each_adapter_costs_its_own_rank_whatever_else_is_resident(
    model_dir: Path, folders: dict[str, Path]
) -> None:
    """Beside a rank-64 adapter, rank-4 and rank-2 adapters keep rank-4 slots (their rank
    class), not the largest resident rank: every stack holds exactly one rank-4 class of two
    slots and one rank-64 slot. Their rows decode bit for bit as before the rank-64 adapter
    came and after it left, and every row of a mixed batch matches PEFT."""
    model = load_base(model_dir)
    linears = linear_shapes(model)
    dec = Decoder(model)
    rows: list[str | None] = ["a", "c", None, "a"]
    ids = torch.randint(3, 300, (len(rows), 7), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        install(dec, linears, "a", folders["a"])
        install(dec, linears, "c", folders["c"])
        before = mixed_logprobs(dec, rows, ids)
        install(dec, linears, "big", folders["big"])
        assert dec.capacity == {4: 2, 64: 1}
        for stacks, _ in dec.targets.values():
            assert isinstance(stacks, LoraStacks)
            # A fused projection's B rows hold their own sub-projection's outputs only.
            n, width = len(stacks.outs), stacks.in_features + max(stacks.outs)
            assert stacks.a[4].shape == (2, stacks.in_features, n * 4)
            held = sum(t.nbytes for t in (*stacks.a.values(), *stacks.b.values()))
            assert held == 4 * n * width * (2 * 4 + 64)  # float32: own classes' ranks only
        assert torch.equal(mixed_logprobs(dec, rows, ids), before)
    check_rows(dec, model_dir, folders, ["big", "a", None, "big", "c", "a"])
    with torch.inference_mode():
        dec.remove("big")
        assert dec.capacity == {4: 2}
        assert torch.equal(mixed_logprobs(dec, rows, ids), before)


def test_weights_cached_per_route_follow_writes_to_its_slots(
    model_dir: Path, folders: dict[str, Path]
) -> None:
    model = load_base(model_dir)
    linears = linear_shapes(model)
    dec = Decoder(model)
    stacks = dec.layers[0].o.lora  # "a" and "d" target it, "c" does not
    x = torch.randn(2, stacks.in_features, generator=torch.Generator())

    def run(route) -> torch.Tensor:
        out = torch.zeros(2, stacks.out_features)
        stacks.add_routed(out, x, route)
        return out

    with torch.inference_mode():
        install(dec, linears, "a", folders["a"])
        install(dec, linears, "c", folders["c"])
        route = make_route([dec.slot("a"), dec.slot("c")])
        first = run(route)
        install(dec, linears, "b", folders["b"])  # another class: the cached weights stay right
        assert torch.equal(run(route), first)
        dec.remove("c")
        install(dec, linears, "d", folders["d"])  # lands in c's slot, which `route` names
        changed = run(route)
        alone = torch.zeros(1, stacks.out_features)
        stacks.add_one(alone, x[1:], dec.slot("d"))
    assert (changed[0] - first[0]).abs().max() <= 1e-6
    assert (changed[1] - alone[0]).abs().max() <= 1e-6 and alone.abs().max() > 1e-3


def test_unknown_targets_and_other_architectures_are_refused(model_dir: Path) -> None:
    model = load_base(model_dir)
    dec = Decoder(model)
    head = torch.zeros(4, 1)
    dec.check_targets(AdapterWeights(1, {"lm_head": (head, head.t())}))  # served (unembed)
    with pytest.raises(InvalidArgument) as embed:
        dec.check_targets(AdapterWeights(1, {"model.embed_tokens": (head, head.t())}))
    assert embed.value.field == WEIGHTS_FILE
    model.config.model_type = "gpt2"
    with pytest.raises(InvalidArgument) as other:
        Decoder(model)
    assert other.value.field == "model_path" and "gpt2" in str(other.value)


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


def test_non_finite_weights_are_refused_by_name_and_huge_finite_ones_pass(
    model_dir: Path, folders: dict[str, Path]
) -> None:
    config, tensors = read_peft_dir(folders["a"])
    linears = linear_shapes(load_base(model_dir))
    target = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    for bad in (math.nan, math.inf, -math.inf):
        poisoned = dict(tensors)
        poisoned[target] = tensors[target].clone()
        poisoned[target][3, 1] = bad
        with pytest.raises(InvalidArgument) as refused:
            check_fits(poisoned, config, linears, 64)
        assert refused.value.field == WEIGHTS_FILE and target in str(refused.value)
    # Finite values whose sum overflows float32: the one-pass check must not refuse them.
    huge = {k: torch.full_like(t, 3e38) for k, t in tensors.items()}
    check_fits(huge, config, linears, 64)


def test_slot_cache_moves_rows_and_grows_without_changing_them() -> None:
    cache = SlotCache(2, 3, 4, torch.float32)
    cache.reserve(3, 5)
    rows = [[torch.randn(3, 5, 4) for _ in range(2)] for _ in range(3)]
    for r, kv in enumerate(rows):
        cache.fill(slice(r, r + 1), torch.stack([torch.stack([t, -t]) for t in kv]))
    cache.move(torch.tensor([0]), torch.tensor([2]), 5)  # row 0 leaves, row 2 takes its slot
    cache.reserve(9, 40)
    assert cache.slots >= 9 and cache.capacity == 40
    for slot, r in ((0, 2), (1, 1)):
        for layer in range(2):
            assert torch.equal(cache.keys[layer][slot, :, :5], rows[r][layer])
            assert torch.equal(cache.values[layer][slot, :, :5], -rows[r][layer])
    assert not cache.keys[0][:, :, 5:].any()  # fresh columns are zeros, never garbage


def test_slot_cache_grows_columns_for_the_rows_asked_not_an_earlier_batchs() -> None:
    """A batch of many short rows, then a few long ones: the columns grow for the rows asked
    for (rows from there on are free), not for every slot the short batch needed."""
    cache = SlotCache(2, 3, 4, torch.float32)
    cache.reserve(128, 8)
    kv = torch.randn(2, 2, 3, 8, 4)
    cache.fill(slice(0, 2), kv)
    cache.reserve(4, 1_000)
    assert cache.slots == 4 and cache.capacity == 1_000
    assert cache.store is not None and cache.store.shape == (2, 2, 4, 3, 1_000, 4)
    for row in (0, 1):  # live rows keep their columns
        assert torch.equal(cache.store[:, :, row, :, :8], kv)
    cache.reserve(5, 1_000)  # more rows double
    assert cache.slots == 8 and torch.equal(cache.store[:, :, 1, :, :8], kv)


def test_chunked_batched_prefill_with_partial_outputs_equals_whole_prompts(
    model_dir: Path, folders: dict[str, Path]
) -> None:
    """Prompts prefilled in chunks that share batches (other prompts' chunks beside them, over
    attention blocks), reading back none, the last or every position, give the keys, values
    and final hidden states of each prompt prefilled whole and alone."""
    model = load_base(model_dir)
    dec = Decoder(model)
    gen = torch.Generator().manual_seed(5)
    prompts = {
        "a": torch.randint(3, 300, (200,), generator=gen),
        None: torch.randint(3, 300, (150,), generator=gen),
    }

    def buffers(length: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (dec.kv_heads, length, dec.head_dim)
        return [torch.zeros(shape) for _ in dec.layers], [torch.zeros(shape) for _ in dec.layers]

    with torch.inference_mode():
        install(dec, linear_shapes(model), "a", folders["a"])
        whole = {}
        for name, ids in prompts.items():
            keys, values = buffers(len(ids))
            part = PrefillPart(ids, 0, keys, values, dec.slot(name), len(ids))
            whole[name] = (dec.prefill([part]), keys, values)
        chunked = {name: buffers(len(ids)) for name, ids in prompts.items()}
        # (prompt, start, end, outputs) parts of three batches
        batches = [
            [("a", 0, 70, 0), (None, 0, 130, 5)],
            [(None, 130, 150, 1), ("a", 70, 190, 120)],
            [("a", 190, 200, 1)],
        ]
        for batch in batches:
            parts = [
                PrefillPart(
                    prompts[name][start:end],
                    start,
                    *chunked[name],
                    dec.slot(name),
                    outputs,
                )
                for name, start, end, outputs in batch
            ]
            hidden = dec.prefill(parts)
            assert hidden.shape[0] == sum(outputs for *_, outputs in batch)
            first = 0
            for name, _start, end, outputs in batch:
                expected = whole[name][0][end - outputs : end]
                got = hidden[first : first + outputs]
                assert got.shape == expected.shape and torch.allclose(got, expected, atol=1e-5)
                first += outputs
        for name in prompts:
            for got, want in zip(
                chunked[name][0] + chunked[name][1], whole[name][1] + whole[name][2], strict=True
            ):
                assert (got - want).abs().max() <= 1e-5
        keys, values = buffers(10)
        nothing = dec.prefill([PrefillPart(prompts[None][:10], 0, keys, values, 0, 0)])
        assert nothing.shape == (0, dec.embed.shape[1])
        with pytest.raises(ValueError, match="outputs 11"):
            dec.prefill([PrefillPart(prompts[None][:10], 0, keys, values, 0, 11)])
