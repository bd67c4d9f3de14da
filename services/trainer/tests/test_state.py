"""Determinism, save/load/continue, torn saves, fences, and the PEFT round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lorafleet.errors import AlreadyExists, FailedPrecondition
from lorafleet_trainer.domain import (
    AdamParams,
    Datum,
    ForwardBackwardInput,
    ForwardBackwardItem,
    LoraSpec,
    StateRef,
)

SPEC = LoraSpec(rank=4, seed=9, dropout=0.3, train_unembed=True)
HP = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)


def batch(seed: int, n: int = 2) -> list[Datum]:
    gen = torch.Generator().manual_seed(seed)
    return [
        Datum(
            torch.randint(0, 256, (7,), generator=gen).tolist(),
            {"target_tokens": torch.randint(0, 256, (7,), generator=gen), "weights": torch.ones(7)},
        )
        for _ in range(n)
    ]


def train(engine, slot: int, reg: str, step: int) -> None:
    for k in range(2):
        (out,) = engine.forward_backward(
            [
                ForwardBackwardItem(
                    f"fb{step}.{k}",
                    slot,
                    reg,
                    ForwardBackwardInput(batch(10 * step + k), "cross_entropy"),
                )
            ]
        )
        assert not isinstance(out, Exception)
    assert engine.optim_step(f"step{step}", slot, reg, HP).applied


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def folder_of(ref: StateRef) -> Path:
    return Path(ref.uri.removeprefix("file://"))


def test_seeded_runs_give_byte_identical_states(make_engine, tmp_path) -> None:
    saved = []
    for run in range(2):
        engine = make_engine()
        engine.storage_root = tmp_path / f"run{run}"
        engine.bind(1, "reg", SPEC)
        for step in range(2):
            train(engine, 1, "reg", step)
        saved.append(files(folder_of(engine.save_state("save", 1, "reg", "s", True))))
    assert saved[0] == saved[1]
    # Dropout is live: the same run without dropout ends elsewhere.
    engine = make_engine()
    engine.storage_root = tmp_path / "nodrop"
    engine.bind(1, "reg", LoraSpec(rank=4, seed=9, dropout=0.0, train_unembed=True))
    for step in range(2):
        train(engine, 1, "reg", step)
    plain = files(folder_of(engine.save_state("save", 1, "reg", "s", True)))
    assert plain["adapter_model.safetensors"] != saved[0]["adapter_model.safetensors"]


def test_save_load_continue_equals_uninterrupted(make_engine, h) -> None:
    straight = make_engine()
    straight.bind(0, "reg", SPEC)
    train(straight, 0, "reg", 0)
    ref = straight.save_state("save", 0, "reg", "mid", True)
    train(straight, 0, "reg", 1)

    resumed = make_engine()
    resumed.storage_root = straight.storage_root
    resumed.bind(2, "reg2", SPEC)
    resumed.load_state("load", 2, "reg2", ref, True)
    assert resumed.slots.bindings[2].optimizer.steps == 1
    assert "fb0.0" in resumed.slots.bindings[2].ops  # applied ids travel with the state
    train(resumed, 2, "reg2", 1)
    a, b = h.adapter_tensors(straight, 0), h.adapter_tensors(resumed, 2)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ma = straight.slots.bindings[0].optimizer.moments()
    mb = resumed.slots.bindings[2].optimizer.moments()
    assert all(torch.equal(ma[i][j], mb[i][j]) for i in ma for j in (0, 1))


def test_torn_save_is_detected_and_changes_nothing(make_engine, h) -> None:
    engine = make_engine()
    engine.bind(0, "reg", SPEC)
    train(engine, 0, "reg", 0)
    ref = engine.save_state("save", 0, "reg", "s", True)
    folder = folder_of(ref)
    blob = (folder / "optimizer.safetensors").read_bytes()
    (folder / "optimizer.safetensors").write_bytes(blob[: len(blob) // 2])
    before = h.snapshot(engine)
    with pytest.raises(FailedPrecondition) as err:
        engine.load_state("load", 0, "reg", ref, True)
    assert err.value.reason == "TORN_STATE"
    (folder / "optimizer.safetensors").write_bytes(blob)
    (folder / "manifest.json").unlink()
    with pytest.raises(FailedPrecondition, match="manifest"):
        engine.load_state("load", 0, "reg", ref, True)
    h.assert_same(before, h.snapshot(engine))


def test_fences(make_engine, h) -> None:
    engine = make_engine()
    engine.bind(0, "reg", SPEC)
    engine.bind(1, "other", LoraSpec(rank=8, seed=9, dropout=0.3, train_unembed=True))
    engine.bind(2, "third", LoraSpec(rank=4, seed=9, train_mlp=False))
    train(engine, 0, "reg", 0)
    ref = engine.save_state("save", 0, "reg", "s", True)
    with pytest.raises(AlreadyExists):
        engine.save_state("save-again", 0, "reg", "s", True)
    before = h.snapshot(engine)
    with pytest.raises(FailedPrecondition, match="rank is 4 in the saved state but 8"):
        engine.load_state("l1", 1, "other", ref, True)
    with pytest.raises(FailedPrecondition, match="target modules differ"):
        engine.load_state("l2", 2, "third", ref, True)
    h.assert_same(before, h.snapshot(engine))
    engine.forward_backward(
        [ForwardBackwardItem("fb", 0, "reg", ForwardBackwardInput(batch(1), "cross_entropy"))]
    )
    before = h.snapshot(engine)
    for call in (
        lambda: engine.save_state("s2", 0, "reg", "s2", True),
        lambda: engine.load_state("l3", 0, "reg", ref, True),
    ):
        with pytest.raises(FailedPrecondition, match="un-stepped gradients"):
            call()
    h.assert_same(before, h.snapshot(engine))
    assert not (Path(engine.storage_root) / "reg" / "s2").exists()


def _peft_logprobs(pm, tokens: list[int]) -> torch.Tensor:
    logits = pm(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1)


def _engine_logprobs(engine, slot: int, reg: str, tokens: list[int]) -> torch.Tensor:
    n = len(tokens)
    data = [
        Datum(
            tokens,
            {"target_tokens": torch.arange(256).repeat(n, 1), "weights": torch.zeros(n, 256)},
        )
    ]
    (out,) = engine.forward_backward(
        [
            ForwardBackwardItem(
                "", slot, reg, ForwardBackwardInput(data, "cross_entropy", forward_only=True)
            )
        ]
    )
    return out.logprobs[0]


def test_exported_adapter_loads_in_peft_with_same_logits(make_engine, h, model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    engine = make_engine()
    engine.bind(
        3,
        "reg",
        LoraSpec(
            rank=4,
            seed=5,
            target_modules=("all-linear",),
            exclude_modules=("model.layers.1.mlp.up_proj",),
            train_unembed=True,
        ),
    )
    h.perturb(engine, 3, seed=1)
    out = tmp_path / "export"
    engine.export_adapter(3, "reg", out)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, str(out)).eval()
    tokens = [5, 17, 200, 3, 99, 42]
    diff = (_engine_logprobs(engine, 3, "reg", tokens) - _peft_logprobs(pm, tokens)).abs().max()
    assert diff <= 1e-5


def test_import_of_a_peft_adapter_trained_elsewhere(make_engine, model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    pm = get_peft_model(
        base,
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 256, (2, 12))
    for _ in range(3):
        pm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    pm.save_pretrained(str(tmp_path / "peft"))
    pm.eval()

    engine = make_engine()
    engine.bind(0, "reg", LoraSpec(rank=8, alpha=16, train_mlp=False))
    engine.import_adapter("imp", 0, "reg", tmp_path / "peft")
    tokens = ids[0].tolist()
    diff = (_engine_logprobs(engine, 0, "reg", tokens) - _peft_logprobs(pm, tokens)).abs().max()
    assert diff <= 1e-5
    engine.bind(1, "reg-b", LoraSpec(rank=4, alpha=16, train_mlp=False))
    with pytest.raises(FailedPrecondition, match="r is 8 in the adapter but 4"):
        engine.import_adapter("imp", 1, "reg-b", tmp_path / "peft")


def test_an_operation_id_replays_only_its_own_kind(make_engine, h) -> None:
    """A retried operation is answered from the dedup log with its first result; an id that
    names an operation of another kind is refused, never answered with that other result."""
    engine = make_engine()
    engine.bind(0, "reg", SPEC)
    train(engine, 0, "reg", 0)
    first = engine.save_state("save", 0, "reg", "s", True)
    assert engine.save_state("save", 0, "reg", "s", True) == first  # a retry: same result
    before = h.snapshot(engine)
    with pytest.raises(FailedPrecondition, match="another kind") as refused:
        engine.save_state("step0", 0, "reg", "t", True)  # step0 was an optim_step
    assert refused.value.field == "operation_id"
    with pytest.raises(FailedPrecondition, match="another kind"):
        engine.optim_step("save", 0, "reg", HP)
    h.assert_same(before, h.snapshot(engine))
    assert not (Path(engine.storage_root) / "reg" / "t").exists()
