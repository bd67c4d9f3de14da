"""SGLangEngine against the schema-faithful fake SGLang server (and a real one when given)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
import torch
from fake_sglang import FakeSGLang
from rollout_helpers import make_adapter, reference_greedy, reference_logprobs, reference_model

from lorafleet.errors import InvalidArgument, NotFound
from lorafleet_rollout.sglang_engine import SGLangEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

PROMPT = (5, 17, 33, 90, 12, 7)
GREEDY = SamplingSpec(max_tokens=8, temperature=0.0, disable_eos_stop=True)


@pytest.fixture(scope="module")
def fake(model_dir: Path) -> FakeSGLang:
    with FakeSGLang(model_dir) as server:
        yield server


async def test_driver_loads_samples_and_unloads(
    fake: FakeSGLang, model_dir: Path, tmp_path: Path
) -> None:
    folder = make_adapter(model_dir, tmp_path / "a", seed=1)
    engine = SGLangEngine(fake.url, model_dir)
    await engine.start()
    try:
        await engine.load_adapter("reg-x@1", folder, LoraSpec(4, 8))
        with pytest.raises(InvalidArgument, match="already loaded"):
            await engine.load_adapter("reg-x@1", folder, LoraSpec(4, 8))

        request = SampleRequest("reg-x@1", PROMPT, GREEDY, prompt_logprobs=True)
        result = await engine.sample(request)
        ref = reference_model(model_dir, folder)
        (seq,) = result.sequences
        assert list(seq.tokens) == reference_greedy(ref, list(PROMPT), 8)
        expected = reference_logprobs(ref, [*PROMPT, *seq.tokens])[len(PROMPT) - 1 :]
        assert (torch.tensor(seq.logprobs) - expected).abs().max() <= 1e-4
        assert torch.tensor(result.prompt_logprobs[0]).isnan()
        assert (
            torch.tensor(result.prompt_logprobs[1:]) - reference_logprobs(ref, list(PROMPT))
        ).abs().max() <= 1e-4

        base = await engine.sample(SampleRequest(None, PROMPT, GREEDY))
        assert list(base.sequences[0].tokens) == reference_greedy(
            reference_model(model_dir, None), list(PROMPT), 8
        )
        many = await engine.sample(
            SampleRequest("reg-x@1", PROMPT, SamplingSpec(5, 1.0, seed=3), num_samples=3)
        )
        assert len(many.sequences) == 3

        await engine.unload_adapter("reg-x@1")
        with pytest.raises(NotFound):
            await engine.sample(request)
        with pytest.raises(InvalidArgument):
            await engine.unload_adapter("reg-x@1")
    finally:
        await engine.close()


async def test_streaming_gives_the_same_tokens(fake: FakeSGLang, model_dir: Path) -> None:
    plain, streaming = (
        SGLangEngine(fake.url, model_dir),
        SGLangEngine(fake.url, model_dir, stream=True),
    )
    await plain.start()
    await streaming.start()
    try:
        request = SampleRequest(None, PROMPT, GREEDY)
        a, b = await plain.sample(request), await streaming.sample(request)
        assert a.sequences == b.sequences and len(b.sequences[0].tokens) == 8
    finally:
        await plain.close()
        await streaming.close()


async def test_fake_enforces_the_schema(fake: FakeSGLang, model_dir: Path, tmp_path: Path) -> None:
    folder = make_adapter(model_dir, tmp_path / "b", seed=2)
    async with httpx.AsyncClient(base_url=fake.url, timeout=60) as http:
        ok = await http.post(
            "/load_lora_adapter", json={"lora_name": "b", "lora_path": str(folder)}
        )
        assert ok.status_code == 200 and ok.json()["success"]
        sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        batch = await http.post(
            "/generate",
            json={"input_ids": [list(PROMPT), list(PROMPT)], "sampling_params": sp,
                  "lora_path": ["b", None]},
        )  # fmt: skip
        assert batch.status_code == 200
        adapted, base = (item["output_ids"] for item in batch.json())
        assert adapted == reference_greedy(reference_model(model_dir, folder), list(PROMPT), 6)
        assert base == reference_greedy(reference_model(model_dir, None), list(PROMPT), 6)
        assert batch.json()[0]["meta_info"]["finish_reason"]["type"] == "length"

        unknown = await http.post(
            "/generate", json={"input_ids": list(PROMPT), "sampling_params": sp, "lora_path": "zz"}
        )
        assert unknown.status_code == 400
        assert set(unknown.json()) == {"success", "error_message", "loaded_adapters"}
        missing = await http.post(
            "/generate", json={"input_ids": list(PROMPT), "sampling_params": sp}
        )
        assert missing.status_code == 400  # no lora_path: real SGLang would silently use the base
        typo = await http.post(
            "/generate",
            json={"input_ids": list(PROMPT), "sampling_params": {**sp, "max_tokens": 3},
                  "lora_path": None},
        )  # fmt: skip
        assert typo.status_code == 400

        stream = await http.post(
            "/generate",
            json={
                "input_ids": list(PROMPT),
                "sampling_params": sp,
                "lora_path": "b",
                "stream": True,
            },
        )
        frames = [line for line in stream.text.split("\n\n") if line]
        assert frames[-1] == "data: [DONE]" and all(f.startswith("data: ") for f in frames)
        assert len(frames) == 7


@pytest.mark.gpu
@pytest.mark.sglang
async def test_real_sglang_server(tmp_path: Path) -> None:
    """On a GPU cluster: SGLANG_URL and SGLANG_MODEL_PATH (a local folder the server loaded)."""
    model_dir = Path(os.environ["SGLANG_MODEL_PATH"])
    folder = make_adapter(model_dir, tmp_path / "real", seed=1, scale=4.0)
    engine = SGLangEngine(os.environ["SGLANG_URL"], model_dir)
    await engine.start()
    try:
        await engine.load_adapter("lorafleet-test@1", folder, LoraSpec(4, 8))
        prompt = tuple(range(10, 30))
        adapted = await engine.sample(SampleRequest("lorafleet-test@1", prompt, GREEDY))
        base = await engine.sample(SampleRequest(None, prompt, GREEDY))
        assert adapted.sequences[0].tokens != base.sequences[0].tokens
        ref = reference_model(model_dir, folder)
        tokens = [*prompt, *adapted.sequences[0].tokens]
        expected = reference_logprobs(ref, tokens)[len(prompt) - 1 :]
        assert (torch.tensor(adapted.sequences[0].logprobs) - expected).abs().max() < 5e-2
        with pytest.raises(NotFound):
            await engine.sample(SampleRequest("lorafleet-missing@1", prompt, GREEDY))
    finally:
        await engine.unload_adapter("lorafleet-test@1")
        await engine.close()
