"""The torch engine on the families beyond Llama/Qwen: Qwen3-MoE and Qwen2-MoE (top-k routing,
per-expert LoRA in PEFT's `target_parameters` layout, Qwen2-MoE's gated shared expert) and
Phi-3 (fused qkv_proj / gate_up_proj, partial rotary, a sliding window). Each against
transformers + PEFT in-process: prompt and generated logprobs within 1e-4, greedy tokens equal
to `generate`, with two adapters of different ranks and base rows mixed in one batch."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from rollout_helpers import (
    REPO,
    load_base,
    reference_generate,
    reference_greedy,
    reference_logprobs,
    reference_model,
)
from transformers import AutoModelForCausalLM, Phi3Config, Qwen2MoeConfig

from lorafleet.errors import InvalidArgument, NotFound
from lorafleet.families import TORCH_ENGINE_FAMILIES, check_torch_servable, torch_engine_refusal
from lorafleet.testing import child_env
from lorafleet_rollout.peft_io import WEIGHTS_FILE
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

MODELS = REPO / ".cache" / "models"
PROMPTS = ((5, 17, 33, 90, 12, 7), (40, 41, 300, 7, 9, 250, 11, 3, 60), (100, 200, 8))
GREEDY = SamplingSpec(max_tokens=10, temperature=0.0, disable_eos_stop=True)
HOT = SamplingSpec(12, temperature=1.0, seed=7, disable_eos_stop=True)
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

#: Per model: two adapters, (rank, target_modules, target_parameters); the second targets
#: fewer projections at a lower rank, so one batch mixes ranks and target sets.
ADAPTERS: dict[str, tuple[tuple[int, list[str], list[str]], ...]] = {
    "tiny-moe": (
        (4, ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"], EXPERTS),
        (2, [], ["mlp.experts.down_proj"]),  # experts only: the bank alone changes outputs
    ),
    "qwen2-moe": (
        (4, ["q_proj", "v_proj", "up_proj", "down_proj", "shared_expert_gate"], EXPERTS),
        (2, ["o_proj"], ["mlp.experts.gate_up_proj"]),
    ),
    "tiny-phi3": (
        (4, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"], []),
        (2, ["qkv_proj", "down_proj"], []),
    ),
    "phi3-partial": (
        (4, ["qkv_proj", "gate_up_proj", "lm_head"], []),
        (2, ["o_proj", "down_proj"], []),
    ),
}


def _random(folder: Path, config: object) -> Path:
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def build(name: str, root: Path) -> Path:
    """The model folder of `name`: the shared tiny builds, or small random configs for what
    they do not cover (a shared expert; partial rotary with a sliding window)."""
    from lorafleet_models.tiny import ensure_model

    if name == "tiny-moe":
        return ensure_model("tiny-moe", MODELS)
    if name == "tiny-phi3":
        return ensure_model("tiny-phi3", MODELS, steps=20)  # the trainer tests' build
    common = {
        "vocab_size": 320,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 1,
    }
    if name == "qwen2-moe":
        config: object = Qwen2MoeConfig(
            **common,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=6,
            num_experts_per_tok=2,
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    else:
        config = Phi3Config(
            **common,
            intermediate_size=128,
            sliding_window=64,
            original_max_position_embeddings=256,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        )
    return _random(root / name, config)


def make_adapter(
    model_dir: Path, out: Path, seed: int, rank: int, modules: list[str], params: list[str]
) -> Path:
    """A PEFT folder (LoRA on `modules` and on the expert banks `params`) with seeded random,
    non-zero A and B, as PEFT itself saves it."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=modules or None,
        target_parameters=params or None,
        init_lora_weights=False,
    )
    model = get_peft_model(load_base(model_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.mul_(0.5)
    model.save_pretrained(out, save_embedding_layers=False)
    return out


@pytest.fixture(scope="module", params=list(ADAPTERS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model folder, [adapter folders]) of one family."""
    root = tmp_path_factory.mktemp(request.param)
    model_dir = build(request.param, root)
    folders = [
        make_adapter(model_dir, root / f"adapter{i}", 10 + i, *spec)
        for i, spec in enumerate(ADAPTERS[request.param])
    ]
    return model_dir, folders


async def _engine(model_dir: Path, folders: list[Path], native: bool = True) -> TorchEngine:
    engine = TorchEngine(model_dir, max_batch_size=16, native_kernels=native)
    await engine.start()
    for i, folder in enumerate(folders):
        rank = json.loads((folder / "adapter_config.json").read_text())["r"]
        await engine.load_adapter(f"r{i}@1", folder, LoraSpec(rank, 2 * rank))
    return engine


async def test_mixed_adapter_batch_equals_transformers_peft(served) -> None:
    """Two adapters of ranks 4 and 2 and base rows, greedy and sampled, in one batch: every
    prompt and generated logprob within 1e-4 of transformers + PEFT, greedy tokens equal."""
    model_dir, folders = served
    names = ["r0@1", "r1@1", None]
    requests = [
        SampleRequest(names[i % 3], PROMPTS[i % 3], GREEDY, prompt_logprobs=True) for i in range(3)
    ] + [SampleRequest(names[i % 3], PROMPTS[(i + 1) % 3], HOT, num_samples=2) for i in range(3)]
    engine = await _engine(model_dir, folders)
    try:
        results = await asyncio.gather(*(engine.sample(r) for r in requests))
        # EOS stopping on: the engine's greedy output is transformers' `generate`.
        eos = await asyncio.gather(
            *(engine.sample(SampleRequest(n, PROMPTS[0], SamplingSpec(10, 0.0))) for n in names)
        )
    finally:
        await engine.close()
    refs = {n: reference_model(model_dir, None if n is None else folders[int(n[1])]) for n in names}
    for request, result in zip(requests, results, strict=True):
        ref, prompt = refs[request.adapter_id], list(request.prompt_tokens)
        for seq in result.sequences:
            expected = reference_logprobs(ref, [*prompt, *seq.tokens])
            got = torch.tensor([*result.prompt_logprobs[1:], *seq.logprobs])
            if not request.prompt_logprobs:
                expected = expected[len(prompt) - 1 :]
            assert (got - expected).abs().max() <= 1e-4, request
            if request.params.temperature == 0:
                assert list(seq.tokens) == reference_greedy(ref, prompt, GREEDY.max_tokens)
    for name, result in zip(names, eos, strict=True):
        assert list(result.sequences[0].tokens) == reference_generate(refs[name], [*PROMPTS[0]], 10)
    # Every adapter visibly changes the outputs (the expert-only one included).
    base = results[2].prompt_logprobs[1:]
    for i in (0, 1):
        lp = reference_logprobs(refs[names[i]], list(PROMPTS[2]))
        assert (lp - torch.tensor(base)).abs().max() > 1e-3


async def test_native_kernels_equal_torch_ops(served) -> None:
    """The native attention and dense LoRA kernels beside the torch-op experts give the same
    tokens and logprobs (within 1e-5) as torch ops throughout."""
    model_dir, folders = served
    names = ["r0@1", "r1@1", None]
    requests = [SampleRequest(n, p, HOT, 2) for n, p in zip(names, PROMPTS, strict=True)]
    results = []
    for native in (True, False):
        engine = await _engine(model_dir, folders, native)
        try:
            results.append(await asyncio.gather(*(engine.sample(r) for r in requests)))
        finally:
            await engine.close()
    for a, b in zip(*results, strict=True):
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert x.tokens == y.tokens
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= 1e-5


async def test_sliding_window_caps_the_context(tmp_path: Path) -> None:
    """A window shorter than the positions caps the context length at the window (within it
    no key is masked, so attention stays exact)."""
    engine = TorchEngine(build("phi3-partial", tmp_path))
    await engine.start()
    try:
        assert engine.info().max_context_length == 64
    finally:
        await engine.close()


async def test_a_bad_expert_adapter_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """An expert bank with the wrong per-expert layout, or keys no target_parameters selects,
    are refused naming the file; the engine serves exactly as before."""
    model_dir = build("tiny-moe", tmp_path)
    good = make_adapter(model_dir, tmp_path / "good", 3, 4, ["o_proj"], EXPERTS)
    engine = await _engine(model_dir, [good])
    try:
        before = await engine.sample(SampleRequest("r0@1", PROMPTS[0], GREEDY))
        config = json.loads((good / "adapter_config.json").read_text())
        from safetensors.torch import load_file, save_file

        tensors = load_file(good / WEIGHTS_FILE)
        key = next(k for k in tensors if "experts" in k and "lora_A" in k)

        def wrong_shape(folder: Path) -> None:
            broken = dict(tensors)
            broken[key] = broken[key][:-1]  # experts * rank - 1 rows
            save_file(broken, folder / WEIGHTS_FILE)
            (folder / "adapter_config.json").write_text(json.dumps(config))

        def unselected(folder: Path) -> None:
            save_file(tensors, folder / WEIGHTS_FILE)
            (folder / "adapter_config.json").write_text(
                json.dumps({**config, "target_parameters": ["mlp.experts.down_proj"]})
            )

        for i, make in enumerate((wrong_shape, unselected)):
            folder = tmp_path / f"bad{i}"
            folder.mkdir()
            make(folder)
            with pytest.raises(InvalidArgument) as err:
                await engine.load_adapter(f"bad{i}@1", folder, LoraSpec(4, 8))
            assert err.value.field == WEIGHTS_FILE and "experts" in err.value.message
        after = await engine.sample(SampleRequest("r0@1", PROMPTS[0], GREEDY))
        assert after == before
        with pytest.raises(NotFound):
            await engine.sample(SampleRequest("bad0@1", PROMPTS[0], GREEDY))
    finally:
        await engine.close()


def test_families_rule_refuses_what_the_engine_does_not_run(tmp_path: Path) -> None:
    """One rule (`lorafleet.families`) for the rollout and `lorafleet up`: an unknown family,
    a length-dependent rope, a non-SiLU MLP are refused naming why; the served ones pass."""
    for family in TORCH_ENGINE_FAMILIES:
        assert torch_engine_refusal({"model_type": family}) is None
    gpt2 = torch_engine_refusal({"model_type": "gpt2"})
    assert gpt2 is not None and "'gpt2'" in gpt2 and "qwen3_moe" in gpt2
    longrope = {"model_type": "phi3", "rope_parameters": {"rope_type": "longrope"}}
    assert "longrope" in (torch_engine_refusal(longrope) or "")
    assert "gelu" in (torch_engine_refusal({"model_type": "llama", "hidden_act": "gelu"}) or "")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(InvalidArgument) as err:
        check_torch_servable(tmp_path)
    assert err.value.field == "model_path" and "'gpt2'" in err.value.message


def test_the_rollout_exits_at_start_on_a_family_it_does_not_serve(tmp_path: Path) -> None:
    """`python -m lorafleet_rollout` on a GPT-2 folder: exit 2 before loading torch, one line
    naming the setting and the families rule's reason."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0
    )
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    env = child_env(LORAFLEET_ROLLOUT_MODEL_PATH=str(tmp_path / "gpt2"))
    proc = subprocess.run(
        [sys.executable, "-m", "lorafleet_rollout"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: LORAFLEET_ROLLOUT_MODEL_PATH={tmp_path / 'gpt2'}: ")
    assert "not 'gpt2'" in line
