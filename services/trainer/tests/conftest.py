"""Trainer test fixtures: a small random Llama on disk and engines built on it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


def build_random_llama(
    folder: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    inter: int = 128,
    vocab: int = 256,
    seed: int = 0,
) -> Path:
    """A random LlamaConfig model saved as an HF folder (fp32), reproducible from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="session")
def moe_model_dir() -> Path:
    """The pre-trained tiny Qwen3-MoE (`lorafleet models build tiny-moe`), cached per machine."""
    from lorafleet_models.tiny import ensure_model

    return ensure_model("tiny-moe", REPO / ".cache" / "models")


@pytest.fixture(scope="session")
def phi3_model_dir() -> Path:
    """A briefly pre-trained tiny Phi-3 (fused qkv_proj and gate_up_proj), cached per machine."""
    from lorafleet_models.tiny import ensure_model

    return ensure_model("tiny-phi3", REPO / ".cache" / "models", steps=20)


def load_engine(folder: Path, storage: Path, num_slots: int = 4, max_rank: int = 16):
    from lorafleet_trainer.engine import TrainerEngine

    return TrainerEngine.from_pretrained(
        folder,
        device="cpu",
        dtype="float32",
        num_slots=num_slots,
        max_rank=max_rank,
        storage_root=storage,
    )


@pytest.fixture
def engine_for(tmp_path: Path):
    """engine_for(model folder, num_slots=4, max_rank=16, storage_root=tmp_path/"states")."""

    def make(folder: Path, storage_root: Path | None = None, **kw):
        return load_engine(folder, storage_root or tmp_path / "states", **kw)

    return make


@pytest.fixture
def make_engine(model_dir: Path, tmp_path: Path):
    from lorafleet_trainer.engine import TrainerEngine

    def make(num_slots: int = 4, max_rank: int = 16):
        return TrainerEngine.from_pretrained(
            model_dir,
            device="cpu",
            dtype="float32",
            num_slots=num_slots,
            max_rank=max_rank,
            storage_root=tmp_path / "states",
        )

    return make


class Helpers:
    """Reference computations and state snapshots shared by the trainer tests."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir

    @staticmethod
    def perturb(engine, slot: int, seed: int, scale: float = 0.05) -> None:
        """Give a slot non-zero B (fresh LoRA has B = 0, which would hide A's gradient)."""
        gen = torch.Generator().manual_seed(seed)
        b = engine.slots.bindings[slot]
        with torch.no_grad():
            for name in b.targets:
                b.a[name].add_(torch.randn(b.a[name].shape, generator=gen) * scale)
                b.b[name].copy_(torch.randn(b.b[name].shape, generator=gen) * scale)

    @staticmethod
    def adapter_tensors(engine, slot: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in engine.layout.tensors(engine.slots.bindings[slot]).items()}

    def peft_model(self, engine, slot: int, dtype: torch.dtype = torch.float32):
        """An in-process PEFT model holding exactly the slot's adapter (the reference), in
        `dtype`: float64 gives the exact value that the engine's float32 result rounds."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        b = engine.slots.bindings[slot]
        base = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=dtype)
        cfg = LoraConfig(
            r=b.spec.rank,
            lora_alpha=b.spec.effective_alpha,
            lora_dropout=0.0,
            target_modules=list(b.targets),
        )
        pm = get_peft_model(base, cfg)
        adapter = {k: v.to(dtype) for k, v in self.adapter_tensors(engine, slot).items()}
        result = set_peft_model_state_dict(pm, adapter)
        assert not result.unexpected_keys
        pm.eval()
        return pm

    @staticmethod
    def peft_grads(pm) -> dict[str, torch.Tensor]:
        return {
            n.replace(".default", ""): p.grad.clone()
            for n, p in pm.named_parameters()
            if "lora_" in n and p.grad is not None
        }

    @staticmethod
    def slot_grads(engine, slot: int) -> dict[str, torch.Tensor]:
        from lorafleet_trainer.checkpoint import peft_key

        b = engine.slots.bindings[slot]
        out = {}
        for name in b.targets:
            out[peft_key(name, "A")] = b.a[name].grad.clone()
            out[peft_key(name, "B")] = b.b[name].grad.clone()
        return out

    @staticmethod
    def snapshot(engine) -> list:
        """Everything a failed call must leave untouched, slot by slot."""
        snap = []
        for b in engine.slots.bindings:
            if b is None:
                snap.append(None)
                continue
            params = b.optimizer.params
            snap.append(
                {
                    "registration": b.registration_id,
                    "weights": [p.detach().clone() for p in params],
                    "grads": [None if p.grad is None else p.grad.clone() for p in params],
                    "moments": {
                        i: (m.clone(), v.clone()) for i, (m, v) in b.optimizer.moments().items()
                    },
                    "steps": b.optimizer.steps,
                    "pending": b.pending_datums,
                    "tokens": b.tokens_trained,
                    "ops": b.ops.ids(),
                }
            )
        return snap

    @staticmethod
    def assert_same(a, b) -> None:
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            if x is None or y is None:
                assert x is y
                continue
            assert x.keys() == y.keys()
            for key in x:
                assert _bit_equal(x[key], y[key]), key


def _bit_equal(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_bit_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_bit_equal(p, q) for p, q in zip(x, y, strict=True))
    return x == y


@pytest.fixture
def h(model_dir: Path) -> Helpers:
    return Helpers(model_dir)


@pytest.fixture
def helpers_for():
    """helpers_for(model folder): the reference helpers on another base model."""
    return Helpers
