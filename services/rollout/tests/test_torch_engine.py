"""TorchEngine against plain transformers + PEFT: logprobs, greedy tokens, batching, stops."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from rollout_helpers import (
    build_model,
    make_adapter,
    reference_generate,
    reference_greedy,
    reference_logprobs,
    reference_model,
)
from transformers import AutoTokenizer

from lorafleet.testing import wait_until_async
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SampleResult, SamplingSpec

PROMPT = (5, 17, 33, 90, 12, 7)
GREEDY = SamplingSpec(max_tokens=10, temperature=0.0, disable_eos_stop=True)


@pytest.fixture
async def engine(model_dir: Path, tmp_path: Path):
    eng = TorchEngine(model_dir, max_batch_size=16)
    await eng.start()
    for i in (1, 2):
        folder = make_adapter(model_dir, tmp_path / f"a{i}", seed=i)
        await eng.load_adapter(f"r{i}@1", folder, LoraSpec(4, 8))
    try:
        yield eng
    finally:
        await eng.close()


async def test_logprobs_and_greedy_match_transformers_peft(
    engine: TorchEngine, model_dir: Path, tmp_path: Path
) -> None:
    ref = reference_model(model_dir, tmp_path / "a1")
    result = await engine.sample(SampleRequest("r1@1", PROMPT, GREEDY))
    (seq,) = result.sequences
    assert list(seq.tokens) == reference_greedy(ref, list(PROMPT), 10)
    expected = reference_logprobs(ref, [*PROMPT, *seq.tokens])[len(PROMPT) - 1 :]
    assert (torch.tensor(seq.logprobs) - expected).abs().max() <= 1e-4
    assert seq.stop_reason == "length"

    # With EOS stopping on (the default), the output equals transformers `generate`.
    eos = await engine.sample(SampleRequest("r1@1", PROMPT, SamplingSpec(10, temperature=0.0)))
    assert list(eos.sequences[0].tokens) == reference_generate(ref, list(PROMPT), 10)

    # Sampled tokens (temperature, top-k, top-p) still report the raw log-softmax.
    hot = SamplingSpec(12, temperature=1.7, top_k=20, top_p=0.9, seed=4, disable_eos_stop=True)
    (sampled,) = (await engine.sample(SampleRequest("r1@1", PROMPT, hot))).sequences
    expected = reference_logprobs(ref, [*PROMPT, *sampled.tokens])[len(PROMPT) - 1 :]
    assert (torch.tensor(sampled.logprobs) - expected).abs().max() <= 1e-4

    base = await engine.sample(SampleRequest(None, PROMPT, GREEDY))
    assert list(base.sequences[0].tokens) == reference_greedy(
        reference_model(model_dir, None), list(PROMPT), 10
    )
    assert base.sequences[0].tokens != seq.tokens  # the adapter really is applied


async def test_qwen3_q_k_norms_match_transformers(tmp_path: Path) -> None:
    """Qwen3's per-head q/k RMSNorm, rotated with q and k together: logprobs equal
    transformers' within 1e-4, greedy tokens identical."""
    model_dir = build_model(tmp_path / "qwen3", arch="qwen3")
    engine = TorchEngine(model_dir)
    await engine.start()
    try:
        (seq,) = (await engine.sample(SampleRequest(None, PROMPT, GREEDY))).sequences
    finally:
        await engine.close()
    ref = reference_model(model_dir, None)
    assert list(seq.tokens) == reference_greedy(ref, list(PROMPT), GREEDY.max_tokens)
    expected = reference_logprobs(ref, [*PROMPT, *seq.tokens])[len(PROMPT) - 1 :]
    assert (torch.tensor(seq.logprobs) - expected).abs().max() <= 1e-4


async def test_native_kernels_equal_torch(model_dir: Path, tmp_path: Path) -> None:
    """The C decode attention and LoRA (`kernels.py`) and their torch fallbacks give the same
    tokens and logprobs within 1e-5: ragged row lengths, grouped-query heads, shared segments,
    rows of two adapters of different ranks (fused q/k/v and gate/up, lm_head) and of none."""
    first = make_adapter(model_dir, tmp_path / "a", seed=5)
    second = make_adapter(
        model_dir,
        tmp_path / "b",
        seed=6,
        rank=2,
        targets=("k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "lm_head"),
    )
    system = tuple(range(40, 140))
    hot = SamplingSpec(12, temperature=1.0, seed=3, disable_eos_stop=True)
    adapters = [None, "r@1", "s@1"]
    requests = [
        SampleRequest(adapters[i % 3], (*system[: 30 + 20 * i], 7 + i), spec, n)
        for i, (spec, n) in enumerate(
            [(GREEDY, 1), (hot, 3), (hot, 1), (GREEDY, 1), (hot, 2), (hot, 2), (GREEDY, 1)]
        )
    ]
    from lorafleet_rollout import kernels

    if kernels.load() is None:
        pytest.skip(f"no native kernels: {kernels.unavailable_reason()}")
    results = []
    for native in (True, False):
        engine = TorchEngine(model_dir, native_kernels=native)
        await engine.start()
        assert (engine._model().native is not None) == native
        await engine.load_adapter("r@1", first, LoraSpec(4, 8))
        await engine.load_adapter("s@1", second, LoraSpec(2, 4))
        try:
            await engine.sample(requests[4])  # a cached prefix: later rows share a segment
            results.append(await asyncio.gather(*(engine.sample(r) for r in requests)))
        finally:
            await engine.close()
    for a, b in zip(*results, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences, strict=True):
            assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= 1e-5


def test_native_shared_segments_equal_one_softmax() -> None:
    """The C shared-segment merge (`kernels.DecodeShared`) equals one softmax over each row's
    own columns followed by its segments': grouped-query heads, segments of different
    lengths read by 1 to 6 rows (3 to 18 query heads: the kernel's dot-product path, one
    lane block, two), rows in any order and in two segments, a segment whose heads are
    strided (a view into a larger buffer); refused shapes raise and write nothing."""
    from lorafleet_rollout import kernels

    native = kernels.load()
    if native is None:
        pytest.skip(f"no native kernels: {kernels.unavailable_reason()}")
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, group, dim, scale = 7, 2, 3, 16, 0.25
    q = torch.randn(rows, kv_heads, group, dim, generator=gen)
    own_k = torch.randn(rows, kv_heads, 11, dim, generator=gen)
    own_v = torch.randn(rows, kv_heads, 11, dim, generator=gen)
    own_len = torch.tensor([11, 4, 7, 1, 9, 2, 5])
    wide = (
        torch.randn(kv_heads, 40, dim, generator=gen),
        torch.randn(kv_heads, 40, dim, generator=gen),
    )
    segments = [  # (keys, values) [kv_heads, n, dim], rows
        (
            (
                torch.randn(kv_heads, 70, dim, generator=gen),
                torch.randn(kv_heads, 70, dim, generator=gen),
            ),
            [4, 0],
        ),
        ((wide[0][:, 5:14], wide[1][:, 5:14]), [2]),
        (
            (
                torch.randn(kv_heads, 3, dim, generator=gen),
                torch.randn(kv_heads, 3, dim, generator=gen),
            ),
            [1, 3],
        ),
        (
            (
                torch.randn(kv_heads, 21, dim, generator=gen),
                torch.randn(kv_heads, 21, dim, generator=gen),
            ),
            [6, 0, 2, 5, 3, 1],
        ),
    ]
    out, peak, total = (torch.empty(rows, kv_heads, group, n) for n in (dim, 1, 1))
    want = torch.empty_like(out)
    for r in range(rows):
        keys, values = own_k[r, :, : own_len[r]], own_v[r, :, : own_len[r]]
        scores = (q[r] @ keys.transpose(-1, -2)) * scale
        out[r] = torch.softmax(scores, -1) @ values
        peak[r] = scores.amax(-1, keepdim=True)
        total[r] = (scores - peak[r]).exp().sum(-1, keepdim=True)
        for (k, v), members in segments:
            if r in members:
                keys, values = torch.cat((keys, k), 1), torch.cat((values, v), 1)
        want[r] = torch.softmax((q[r] @ keys.transpose(-1, -2)) * scale, -1) @ values
    call = native.shared.bind(
        [([seg] * 2, torch.tensor(members)) for seg, members in segments],
        kv_heads,
        group,
        dim,
        scale,
    )
    before = out.clone()
    with pytest.raises(ValueError, match="decode_shared"):
        call(1, q[:6].contiguous(), out[:6], peak[:6], total[:6])  # row 6 is a segment's
    assert torch.equal(out, before)
    call(1, q, out, peak, total)
    assert (out - want).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="decode_shared"):
        native.shared.bind([([segments[0][0]], torch.tensor([0, -1]))], kv_heads, group, dim, 1.0)


async def test_mixed_batch_equals_each_request_alone(engine: TorchEngine) -> None:
    def spec(seed: int, temperature: float = 1.0) -> SamplingSpec:
        return SamplingSpec(
            max_tokens=6 + seed, temperature=temperature, seed=seed, disable_eos_stop=True
        )

    requests = [
        SampleRequest("r1@1", PROMPT, spec(1)),
        SampleRequest("r2@1", PROMPT[:3], spec(2), num_samples=2),
        SampleRequest(None, PROMPT[2:], spec(3)),
        SampleRequest("r1@1", PROMPT[:2], spec(4, temperature=0.0)),
        SampleRequest("r2@1", PROMPT, SamplingSpec(5, temperature=0.8, top_k=5, seed=9)),
    ]
    together = await asyncio.gather(*(engine.sample(r) for r in requests))
    for request, mixed in zip(requests, together, strict=True):
        alone = await engine.sample(request)
        assert [s.tokens for s in mixed.sequences] == [s.tokens for s in alone.sequences]
        for a, b in zip(mixed.sequences, alone.sequences, strict=True):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    two = together[1].sequences
    assert two[0].tokens != two[1].tokens  # num_samples are independent draws


async def test_new_requests_join_a_running_batch(engine: TorchEngine) -> None:
    long = asyncio.ensure_future(
        engine.sample(SampleRequest("r1@1", PROMPT, SamplingSpec(200, 0.0, disable_eos_stop=True)))
    )
    await asyncio.sleep(0.05)
    short = await engine.sample(SampleRequest("r2@1", PROMPT, GREEDY))
    assert not long.done()  # continuous batching: the short one did not wait for the long one
    assert len((await long).sequences[0].tokens) == 200
    assert (
        short.sequences[0].tokens
        == (await engine.sample(SampleRequest("r2@1", PROMPT, GREEDY))).sequences[0].tokens
    )


async def test_stop_tokens_strings_length_and_prompt_logprobs(
    engine: TorchEngine, model_dir: Path, tmp_path: Path
) -> None:
    (free,) = (await engine.sample(SampleRequest("r1@1", PROMPT, GREEDY))).sequences
    stop_tok = free.tokens[3]
    first = free.tokens.index(stop_tok)
    spec = SamplingSpec(10, 0.0, stop_token_ids=(stop_tok,), disable_eos_stop=True)
    (stopped,) = (await engine.sample(SampleRequest("r1@1", PROMPT, spec))).sequences
    assert stopped.tokens == free.tokens[: first + 1] and stopped.stop_reason == "stop"

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.decode(list(free.tokens[:5]))
    needle = text[-2:] if text[-2:].strip() else text[-3:]
    spec = SamplingSpec(10, 0.0, stop_strings=(needle,), disable_eos_stop=True)
    (by_text,) = (await engine.sample(SampleRequest("r1@1", PROMPT, spec))).sequences
    assert by_text.stop_reason == "stop"
    assert needle in tokenizer.decode(list(by_text.tokens))
    assert needle not in tokenizer.decode(list(by_text.tokens[:-1]))  # stop token included
    assert by_text.tokens == free.tokens[: len(by_text.tokens)]

    request = SampleRequest(
        "r1@1", PROMPT, SamplingSpec(1, 0.0), prompt_logprobs=True, topk_prompt_logprobs=3
    )
    result = await engine.sample(request)
    assert len(result.sequences[0].tokens) == 1 and result.sequences[0].stop_reason in (
        "length",
        "stop",
    )
    assert math.isnan(result.prompt_logprobs[0]) and len(result.prompt_logprobs) == len(PROMPT)
    ref = reference_model(model_dir, tmp_path / "a1")
    expected = reference_logprobs(ref, list(PROMPT))
    assert (torch.tensor(result.prompt_logprobs[1:]) - expected).abs().max() <= 1e-4
    assert result.topk_prompt_logprobs[0] == ()
    for t, row in enumerate(result.topk_prompt_logprobs[1:], start=1):
        assert len(row) == 3 and row[0][1] >= row[1][1] >= row[2][1]
        assert row[0][1] >= result.prompt_logprobs[t] - 1e-6


async def test_seed_reproducible_and_num_samples(engine: TorchEngine) -> None:
    spec = SamplingSpec(8, temperature=1.0, seed=123, disable_eos_stop=True)
    a = await engine.sample(SampleRequest("r2@1", PROMPT, spec, num_samples=3))
    b = await engine.sample(SampleRequest("r2@1", PROMPT, spec, num_samples=3))
    assert len(a.sequences) == 3
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({s.tokens for s in a.sequences}) == 3


def prompt_tokens(source: str) -> float:
    value = REGISTRY.get_sample_value("lorafleet_rollout_prompt_tokens_total", {"source": source})
    return value or 0.0


def assert_same(a: SampleResult, b: SampleResult) -> None:
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    for x, y in zip(a.sequences, b.sequences, strict=True):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs, strict=True)) <= 1e-4


async def test_shared_prefixes_equal_each_sample_computed_alone(
    model_dir: Path, tmp_path: Path
) -> None:
    """Prefix reuse, chunked prefill and eviction under a tiny byte bound change no result."""
    folder = make_adapter(model_dir, tmp_path / "a", seed=3)
    system = tuple(range(40, 140))  # 100 shared tokens: 6 cache blocks
    hot = SamplingSpec(8, temperature=1.0, seed=11, disable_eos_stop=True)
    requests = [
        SampleRequest(adapter, (*system, *tail), spec, n)
        for adapter in ("r@1", None)
        for tail, spec, n in (
            ((7, 8, 9), GREEDY, 1),
            ((9, 8), hot, 3),
            ((5,), GREEDY, 2),
            # Cached blocks diverge after the system prompt: decode shares it as one segment.
            ((6, *range(300, 320)), hot, 1),
            ((4, *range(400, 420)), GREEDY, 1),
        )
    ]
    alone = TorchEngine(model_dir, prefix_cache_bytes=0)
    shared = TorchEngine(model_dir, prefill_chunk=32)  # a prompt takes 4 chunks
    tiny = TorchEngine(model_dir, prefix_cache_bytes=3 * 16 * 2 * 2 * 128 * 4, prefill_chunk=16)
    engines = (alone, shared, tiny)
    for engine in engines:
        await engine.start()
        await engine.load_adapter("r@1", folder, LoraSpec(4, 8))
    try:
        expected = [await alone.sample(r) for r in requests]
        for engine in (shared, tiny):
            computed, cached = prompt_tokens("computed"), prompt_tokens("cached")
            together = await asyncio.gather(*(engine.sample(r) for r in requests))
            one_by_one = [await engine.sample(r) for r in requests]
            for want, got, again in zip(expected, together, one_by_one, strict=True):
                assert_same(want, got)
                assert_same(want, again)
            assert engine.prefix_cache.bytes <= engine.prefix_cache.max_bytes
            assert prompt_tokens("cached") > cached
            assert prompt_tokens("computed") - computed < 2 * sum(
                len(r.prompt_tokens) for r in requests
            )
        # Every num_samples > 1 request prefilled its prompt once, the big cache shared the
        # system prompt: the one-by-one pass computed only the tails (the last block is never
        # taken from the cache: its logits pick the first token).
        computed = prompt_tokens("computed")
        await asyncio.gather(*(shared.sample(r) for r in requests))
        assert prompt_tokens("computed") - computed <= len(requests) * (16 + 3)
    finally:
        for engine in engines:
            await engine.close()


async def test_rows_sharing_a_cached_system_prompt_read_it_once(model_dir: Path) -> None:
    """Single-sample requests that share a cached system prompt decode against one copy of
    it: the first to join moves its own columns onto the shared segment when the second
    arrives, so no row reads the system prompt from its own slot; results are unchanged."""
    engine = TorchEngine(model_dir)
    await engine.start()
    system = tuple(range(40, 140))  # 100 tokens: 6 full cache blocks
    requests = [SampleRequest(None, (*system, 7 + i, 8), GREEDY) for i in range(4)]
    try:
        alone = [await engine.sample(r) for r in requests]  # the first caches the prefix
        shared, own = decode_rows("shared"), decode_rows("own")
        together = await asyncio.gather(*(engine.sample(r) for r in requests))
    finally:
        await engine.close()
    for want, got in zip(alone, together, strict=True):
        assert_same(want, got)
    # The first token comes from the prefill; every later one is a decode row.
    assert decode_rows("shared") - shared == len(requests) * (GREEDY.max_tokens - 1)
    assert decode_rows("own") == own


async def test_an_idle_engine_keeps_its_buffers_a_while_then_frees_them(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decode cache and prompt buffers outlive a batch (the next one reuses them, with
    the same results), and are freed once the engine has been idle `_KEEP_IDLE_CACHE`."""
    from lorafleet_rollout import torch_engine

    monkeypatch.setattr(torch_engine, "_KEEP_IDLE_CACHE", 4.0)  # ample on a loaded machine
    engine = TorchEngine(model_dir)
    await engine.start()
    request = SampleRequest(None, PROMPT, GREEDY)
    try:
        first = await engine.sample(request)
        cache = engine._model().cache
        store = cache.store
        assert store is not None and len(engine._kv_pool.spare) == 1
        assert_same(first, await engine.sample(request))
        assert cache.store is store  # reused, not reallocated
        # The engine thread frees the cache, then the spare buffers: wait for both, never
        # for one and then look at the other (CI saw the second a moment late).
        await wait_until_async(
            lambda: cache.store is None and engine._kv_pool.spare == [],
            "the idle engine's cache and spare buffers released",
        )
        assert_same(first, await engine.sample(request))
    finally:
        await engine.close()


def decode_rows(prefix: str) -> float:
    value = REGISTRY.get_sample_value("lorafleet_rollout_decode_rows_total", {"prefix": prefix})
    return value or 0.0


async def test_top_k_one_is_greedy_whatever_the_seed(engine: TorchEngine) -> None:
    (greedy,) = (await engine.sample(SampleRequest("r1@1", PROMPT, GREEDY))).sequences
    three = await engine.sample(SampleRequest("r1@1", PROMPT, GREEDY, num_samples=3))
    assert list(three.sequences) == [greedy] * 3
    for seed in (1, 2, 3):
        spec = SamplingSpec(10, temperature=1.0, top_k=1, seed=seed, disable_eos_stop=True)
        (seq,) = (await engine.sample(SampleRequest("r1@1", PROMPT, spec))).sequences
        assert seq.tokens == greedy.tokens


async def test_lm_head_lora_matches_peft_in_prefill_and_decode(
    model_dir: Path, tmp_path: Path
) -> None:
    """Tinker's default train_unembed=True puts LoRA on lm_head: the engine applies it to
    prompt logprobs (prefill) and to every decoded token, next to rows of other adapters."""
    folder = make_adapter(
        model_dir, tmp_path / "head", seed=7, targets=("q_proj", "lm_head"), scale=4.0
    )
    ref = reference_model(model_dir, folder)
    eng = TorchEngine(model_dir, max_batch_size=8)
    await eng.start()
    try:
        await eng.load_adapter("h@1", folder, LoraSpec(4, 8))
        spec = SamplingSpec(8, temperature=0.0, disable_eos_stop=True)
        mixed = await asyncio.gather(
            eng.sample(SampleRequest("h@1", PROMPT, spec, prompt_logprobs=True)),
            eng.sample(SampleRequest(None, PROMPT, spec)),
        )
        (seq,) = mixed[0].sequences
        assert list(seq.tokens) == reference_greedy(ref, list(PROMPT), 8)
        full = reference_logprobs(ref, [*PROMPT, *seq.tokens])
        assert (torch.tensor(seq.logprobs) - full[len(PROMPT) - 1 :]).abs().max() <= 1e-4
        prompt = torch.tensor(mixed[0].prompt_logprobs[1:])
        assert (prompt - full[: len(PROMPT) - 1]).abs().max() <= 1e-4
        base = reference_greedy(reference_model(model_dir, None), list(PROMPT), 8)
        assert list(mixed[1].sequences[0].tokens) == base
    finally:
        await eng.close()


async def test_a_rank_class_compacted_mid_decode_keeps_each_row_on_its_adapter(
    model_dir: Path, tmp_path: Path
) -> None:
    """Removals that leave a rank class more than an eighth empty compact it: the adapters
    past the end move into the holes and the stacks shrink (adapter_slots.py). A request
    decoding on a moved adapter goes on with its own weights: its tokens and logprobs equal
    the same request alone, bit for bit."""
    eng = TorchEngine(model_dir, max_batch_size=16)
    await eng.start()
    try:
        for i in range(4):
            folder = make_adapter(model_dir, tmp_path / f"c{i}", seed=30 + i)
            await eng.load_adapter(f"c{i}@1", folder, LoraSpec(4, 8))
        model = eng._model()
        assert model.capacity == {4: 4}
        request = SampleRequest("c3@1", PROMPT, SamplingSpec(400, 0.0, disable_eos_stop=True))
        alone = await eng.sample(request)
        name = eng._names["c3@1"]  # the engine's own name for it
        slot, layout = model.slot(name), model.layout
        running = asyncio.ensure_future(eng.sample(request))
        await wait_until_async(lambda: bool(eng._batch.seqs), "the request decoding")
        for i in range(3):
            await eng.unload_adapter(f"c{i}@1")
        assert not running.done()  # the move happened while it decoded
        assert model.layout > layout and model.slot(name) != slot
        assert model.capacity == {4: 2}  # 1 held, one slot spare (an eighth, at least 1)
        moved = await running
        assert [s.tokens for s in moved.sequences] == [s.tokens for s in alone.sequences]
        assert [s.logprobs for s in moved.sequences] == [s.logprobs for s in alone.sequences]
        await eng.unload_adapter("c3@1")
        assert model.capacity == {} and model.stack_bytes() == 0
    finally:
        await eng.close()
