"""SGLangEngine against the strict fake SGLang server (and a real one on a GPU cluster).

The fake (`fake_sglang.py`) refuses what SGLang 0.5.23 refuses and behaves as it does where the
driver must defend itself: silent re-load of unloaded names, forgetting everything on restart,
one seed shared by a request's n copies, temperature-scaled logprobs without
SGLANG_RETURN_ORIGINAL_LOGPROB=1.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx
import pytest
import torch
from fake_sglang import FakeSGLang
from rollout_helpers import make_adapter, reference_greedy, reference_logprobs, reference_model

from lorafleet import contract
from lorafleet.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from lorafleet_rollout import sglang_api
from lorafleet_rollout.sglang_engine import SGLangEngine, _to_result
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

PROMPT = (5, 17, 33, 90, 12, 7)
GREEDY = SamplingSpec(max_tokens=8, temperature=0.0, disable_eos_stop=True)
SEEDED = SamplingSpec(max_tokens=6, temperature=1.0, disable_eos_stop=True, seed=7)


@pytest.fixture(scope="module")
def fake(model_dir: Path) -> FakeSGLang:
    with FakeSGLang(model_dir) as server:
        yield server


async def _engine(url: str, model_dir: Path, **kwargs: object) -> SGLangEngine:
    engine = SGLangEngine(url, model_dir, reconcile_interval=0, **kwargs)  # type: ignore[arg-type]
    await engine.start()
    return engine


async def test_driver_loads_samples_and_unloads(
    fake: FakeSGLang, model_dir: Path, tmp_path: Path
) -> None:
    folder = make_adapter(model_dir, tmp_path / "a", seed=1)
    engine = await _engine(fake.url, model_dir)
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

        await engine.unload_adapter("reg-x@1")
        with pytest.raises(NotFound):
            await engine.sample(request)
        with pytest.raises(InvalidArgument):
            await engine.unload_adapter("reg-x@1")
        assert fake.state.loaded() == {}
    finally:
        await engine.close()


async def test_partial_stacks_are_completed_and_served(
    fake: FakeSGLang, model_dir: Path, tmp_path: Path
) -> None:
    """q_proj without v_proj and up_proj without gate_proj: SGLang refuses or cannot place
    them as exported; published with zero partners they load and sample exactly."""
    folder = make_adapter(model_dir, tmp_path / "p", seed=8, targets=("q_proj", "up_proj"))
    async with httpx.AsyncClient(base_url=fake.url, timeout=60) as http:
        raw = await http.post(
            "/load_lora_adapter", json={"lora_name": "raw", "lora_path": str(folder)}
        )
        assert raw.status_code == 400
    engine = await _engine(fake.url, model_dir)
    try:
        await engine.load_adapter("reg-p@1", folder, LoraSpec(4, 8))
        result = await engine.sample(SampleRequest("reg-p@1", PROMPT, GREEDY))
        ref = reference_model(model_dir, folder)
        assert list(result.sequences[0].tokens) == reference_greedy(ref, list(PROMPT), 8)
        tokens = [*PROMPT, *result.sequences[0].tokens]
        expected = reference_logprobs(ref, tokens)[len(PROMPT) - 1 :]
        assert (torch.tensor(result.sequences[0].logprobs) - expected).abs().max() <= 1e-4
        await engine.unload_adapter("reg-p@1")
    finally:
        await engine.close()


async def test_seeded_samples_are_distinct_and_reproducible(
    fake: FakeSGLang, model_dir: Path
) -> None:
    engine = await _engine(fake.url, model_dir)
    try:
        request = SampleRequest(None, PROMPT, SEEDED, num_samples=4)
        first, again = await engine.sample(request), await engine.sample(request)
        tokens = [s.tokens for s in first.sequences]
        assert len(set(tokens)) == 4, tokens
        assert first == again
        body = fake.state.received[-1]
        assert len(body.input_ids) == 4 and {p.n for p in body.sampling_params} == {1}
        # The contract's whole range is usable: a seed above SGLang's int64 limit works.
        top = SamplingSpec(6, 1.0, disable_eos_stop=True, seed=contract.SEED_LIMIT - 1)
        assert len((await engine.sample(SampleRequest(None, PROMPT, top, 2))).sequences) == 2
    finally:
        await engine.close()
    # What the driver avoids: SGLang's n copies of one seeded request are all alike.
    async with httpx.AsyncClient(base_url=fake.url, timeout=120) as http:
        sp = {
            "max_new_tokens": 6,
            "temperature": 1.0,
            "ignore_eos": True,
            "n": 4,
            "sampling_seed": 7,
        }
        same = await http.post(
            "/generate", json={"input_ids": list(PROMPT), "sampling_params": sp, "lora_path": None}
        )
        assert len({tuple(item["output_ids"]) for item in same.json()}) == 1
        too_big = await http.post(
            "/generate",
            json={
                "input_ids": list(PROMPT),
                "lora_path": None,
                "sampling_params": {**sp, "sampling_seed": 2**63},
            },
        )
        assert too_big.status_code == 400 and "sampling_seed" in too_big.json()["error"]["message"]


async def test_unseeded_or_seedless_server_prefills_once(model_dir: Path) -> None:
    """Where seeds change nothing, n samples go as one request with n (SGLang's parallel
    sampling prefills the prompt once); seeded on a deterministic server, as n copies."""
    with FakeSGLang(model_dir, deterministic=False) as fake:
        engine = await _engine(fake.url, model_dir)
        try:
            result = await engine.sample(SampleRequest(None, PROMPT, SEEDED, num_samples=4))
            assert len(result.sequences) == 4  # unseeded draws: equal ones are possible
            (body,) = fake.state.received[-1:]
            assert len(body.input_ids) == 1 and body.sampling_params[0].n == 4
        finally:
            await engine.close()


def test_sample_seeds_follow_the_contract() -> None:
    seeds = [contract.sample_seed(2**64 - 1, i) for i in range(64)]
    assert len(set(seeds)) == 64 and all(0 <= s < contract.ENGINE_SEED_LIMIT for s in seeds)
    assert contract.sample_seed(7, 0) == 7
    with pytest.raises(InvalidArgument):
        contract.sample_seed(2**64, 0)


async def test_streaming_keeps_every_sample(fake: FakeSGLang, model_dir: Path) -> None:
    plain = await _engine(fake.url, model_dir)
    streaming = await _engine(fake.url, model_dir, stream=True)
    try:
        for request in (
            SampleRequest(None, PROMPT, GREEDY),
            SampleRequest(None, PROMPT, SEEDED, num_samples=3),
        ):
            a, b = await plain.sample(request), await streaming.sample(request)
            assert a.sequences == b.sequences
            assert len(b.sequences) == request.num_samples
    finally:
        await plain.close()
        await streaming.close()


async def test_retired_version_is_never_served(
    fake: FakeSGLang, model_dir: Path, tmp_path: Path
) -> None:
    folder = make_adapter(model_dir, tmp_path / "r", seed=3)
    engine = await _engine(fake.url, model_dir)
    try:
        await engine.load_adapter("reg-r@1", folder, LoraSpec(4, 8))
        (name,) = fake.state.loaded()
        await engine.unload_adapter("reg-r@1")
        with pytest.raises(NotFound):
            await engine.sample(SampleRequest("reg-r@1", PROMPT, GREEDY))
        # Even a request naming the retired server name directly finds nothing to re-load.
        async with httpx.AsyncClient(base_url=fake.url, timeout=60) as http:
            sp = {"max_new_tokens": 4, "temperature": 0.0}
            stale = await http.post(
                "/generate",
                json={"input_ids": list(PROMPT), "sampling_params": sp, "lora_path": name},
            )
            assert stale.status_code == 400
            assert "Failed to implicitly load LoRA adapter" in stale.json()["error"]["message"]
            assert (await http.get("/health")).status_code == 200
        assert fake.state.loaded() == {}
        # Re-publishing the same adapter id gets a fresh server name.
        await engine.load_adapter("reg-r@1", folder, LoraSpec(4, 8))
        assert name not in fake.state.loaded() and len(fake.state.loaded()) == 1
        await engine.unload_adapter("reg-r@1")
    finally:
        await engine.close()


async def test_fake_reloads_an_unloaded_name_as_sglang_does(
    fake: FakeSGLang, model_dir: Path, tmp_path: Path
) -> None:
    folder = make_adapter(model_dir, tmp_path / "s", seed=4)
    async with httpx.AsyncClient(base_url=fake.url, timeout=60) as http:
        assert (
            await http.post("/load_lora_adapter", json={"lora_name": "s", "lora_path": str(folder)})
        ).is_success
        assert (await http.post("/unload_lora_adapter", json={"lora_name": "s"})).is_success
        sp = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        back = await http.post(
            "/generate", json={"input_ids": list(PROMPT), "sampling_params": sp, "lora_path": "s"}
        )
        assert back.status_code == 200
        assert back.json()["output_ids"] == reference_greedy(
            reference_model(model_dir, folder), list(PROMPT), 6
        )
        assert (await http.post("/unload_lora_adapter", json={"lora_name": "s"})).is_success


async def test_restart_is_reconciled(model_dir: Path, tmp_path: Path) -> None:
    folder = make_adapter(model_dir, tmp_path / "k", seed=5)
    with FakeSGLang(model_dir) as fake:
        engine = await _engine(fake.url, model_dir)
        try:
            await engine.load_adapter("reg-k@1", folder, LoraSpec(4, 8))
            request = SampleRequest("reg-k@1", PROMPT, GREEDY)
            before = await engine.sample(request)
            fake.restart()
            assert fake.state.loaded() == {}
            after = await engine.sample(request)  # never loaded, says the server: reconcile
            assert after == before and engine.reloads == 1
            fake.restart()
            assert await engine.reconcile() == 1 and len(fake.state.loaded()) == 1
            assert await engine.reconcile() == 0
            # A name of ours the server still holds but we no longer serve is unloaded.
            async with httpx.AsyncClient(base_url=fake.url, timeout=60) as http:
                stray = {"lora_name": "reg-k@0#stray", "lora_path": str(folder)}
                assert (await http.post("/load_lora_adapter", json=stray)).is_success
            await engine.reconcile()
            assert "reg-k@0#stray" not in fake.state.loaded()
        finally:
            await engine.close()


async def test_restart_is_noticed_without_traffic(model_dir: Path, tmp_path: Path) -> None:
    folder = make_adapter(model_dir, tmp_path / "t", seed=9)
    with FakeSGLang(model_dir) as fake:
        engine = SGLangEngine(fake.url, model_dir, reconcile_interval=0.2)
        await engine.start()
        try:
            await engine.load_adapter("reg-t@1", folder, LoraSpec(4, 8))
            before = fake.state.loaded()
            fake.restart()
            assert await asyncio.to_thread(fake.state.adapter_loaded.wait, 60)
            assert fake.state.loaded() == before  # the same name, from the same folder
        finally:
            await engine.close()


async def test_unservable_adapters_never_reach_the_server(model_dir: Path, tmp_path: Path) -> None:
    no_head = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    with FakeSGLang(model_dir, targets=no_head, max_lora_rank=8) as fake:
        engine = await _engine(fake.url, model_dir)
        try:
            head = make_adapter(model_dir, tmp_path / "h", seed=6, targets=("q_proj", "lm_head"))
            with pytest.raises(InvalidArgument, match="lm_head"):
                await engine.load_adapter("reg-h@1", head, LoraSpec(4, 8))
            wide = make_adapter(model_dir, tmp_path / "w", seed=6, rank=16)
            with pytest.raises(InvalidArgument, match="max-lora-rank 8"):
                await engine.load_adapter("reg-w@1", wide, LoraSpec(16, 32))
            assert fake.state.ref_cache == {}  # the server never saw either
            leftovers = await asyncio.to_thread(os.listdir, tmp_path)
            assert sorted(leftovers) == ["h", "w"]  # nothing published was left behind
            # Loaded directly, the fake refuses them in SGLang's words and shape.
            async with httpx.AsyncClient(base_url=fake.url, timeout=60) as http:
                for folder in (head, wide):
                    answer = await http.post(
                        "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(folder)}
                    )
                    assert answer.status_code == 400
                    body = sglang_api.LoraUpdateResult.model_validate_json(answer.content)
                    assert not body.success and "is incompatible" in (body.error_message or "")
        finally:
            await engine.close()


async def test_server_reporting_scaled_logprobs_is_refused(model_dir: Path) -> None:
    with FakeSGLang(model_dir, original_logprobs=False) as fake:
        engine = SGLangEngine(fake.url, model_dir, reconcile_interval=0)
        with pytest.raises(FailedPrecondition, match="SGLANG_RETURN_ORIGINAL_LOGPROB=1"):
            await engine.start()
        await engine.close()


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
            json={
                "input_ids": [list(PROMPT), list(PROMPT)],
                "sampling_params": sp,
                "lora_path": ["b", None],
            },
        )
        assert batch.status_code == 200
        adapted, base = (item["output_ids"] for item in batch.json())
        assert adapted == reference_greedy(reference_model(model_dir, folder), list(PROMPT), 6)
        assert base == reference_greedy(reference_model(model_dir, None), list(PROMPT), 6)
        assert batch.json()[0]["meta_info"]["finish_reason"]["type"] == "length"

        unknown = await http.post(
            "/generate", json={"input_ids": list(PROMPT), "sampling_params": sp, "lora_path": "zz"}
        )
        assert unknown.status_code == 400
        message = sglang_api.ErrorBody.model_validate_json(unknown.content).error.message
        assert message.startswith(sglang_api.NEVER_LOADED)
        missing = await http.post(
            "/generate", json={"input_ids": list(PROMPT), "sampling_params": sp}
        )
        assert missing.status_code == 400  # no lora_path: real SGLang would silently use the base
        typo = await http.post(
            "/generate",
            json={
                "input_ids": list(PROMPT),
                "sampling_params": {**sp, "max_tokens": 3},
                "lora_path": None,
            },
        )
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
        assert (await http.post("/unload_lora_adapter", json={"lora_name": "b"})).is_success


def test_an_aborted_request_is_unavailable() -> None:
    """SGLang's answer for an aborted request (no prompt_tokens) parses and is retryable."""
    from fake_sglang import _aborted

    result = sglang_api.GenerateResult.model_validate(_aborted("r1"))
    with pytest.raises(Unavailable, match="aborted"):
        _to_result([result], SampleRequest(None, PROMPT, GREEDY))


@pytest.mark.gpu
@pytest.mark.sglang
async def test_real_sglang_server(tmp_path: Path) -> None:
    """On a GPU cluster: SGLANG_URL and SGLANG_MODEL_PATH (a local folder the server loaded)."""
    model_dir = Path(os.environ["SGLANG_MODEL_PATH"])
    folder = make_adapter(model_dir, tmp_path / "real", seed=1, scale=4.0)
    engine = SGLangEngine(os.environ["SGLANG_URL"], model_dir, reconcile_interval=0)
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


def test_a_launched_server_gets_the_fleets_flags(model_dir: Path) -> None:
    """launch=True starts what `sglang_server.py` defines for every lorafleet SGLang."""
    engine = SGLangEngine("http://127.0.0.1:31234", model_dir, max_lora_rank=16, launch=True)
    server = engine.launcher()
    command, env = server.command(), server.env({})
    assert command[command.index("--port") + 1] == "31234"
    assert command[command.index("--max-lora-rank") + 1] == "16"
    assert "lm_head" in command[command.index("--lora-target-modules") + 1 :]
    assert env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"
