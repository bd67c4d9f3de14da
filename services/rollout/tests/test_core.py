"""RolloutCore on a real TorchEngine: versions, retirement, capacity and bad input."""

from __future__ import annotations

import asyncio
import math
import shutil
import statistics
import time
from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY
from rollout_helpers import (
    file_digests,
    make_adapter,
    reference_greedy,
    reference_logprobs,
    reference_model,
)

from lorafleet.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from lorafleet.testing import wait_until_async
from lorafleet_rollout.core import Limits, RolloutCore
from lorafleet_rollout.torch_engine import TorchEngine
from lorafleet_rollout.types import LoraSpec, SampleRequest, SamplingSpec

PROMPT = (5, 17, 33, 90, 12, 7)
LORA = LoraSpec(4, 8)


async def upkeep(core: RolloutCore) -> None:
    """Wait for the cache upkeep a response left running (dropping idle retiring versions)."""
    while core._background:
        await asyncio.gather(*core._background)


def loads_by(cause: str) -> float:
    return REGISTRY.get_sample_value("lorafleet_rollout_adapter_loads_total", {"cause": cause}) or 0


def greedy(n: int) -> SampleRequest:
    return SampleRequest(None, PROMPT, SamplingSpec(n, temperature=0.0, disable_eos_stop=True))


@pytest.fixture
def adapters(model_dir: Path, tmp_path: Path) -> dict[int, Path]:
    return {i: make_adapter(model_dir, tmp_path / f"src{i}", seed=i) for i in range(1, 5)}


@pytest.fixture
async def core(model_dir: Path, tmp_path: Path):
    limits = Limits(max_loaded_adapters=4, max_queued_requests=8, max_num_samples=4)
    c = RolloutCore(TorchEngine(model_dir), limits, tmp_path / "resident")
    await c.start()
    try:
        yield c
    finally:
        await c.close()


async def push(core: RolloutCore, reg: str, version: int, folder: Path, tmp: Path):
    staged = tmp / f"staged-{reg}-{version}"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(folder, staged)
    return await core.load_adapter(reg, version, LORA, staged, file_digests(folder))


async def test_publish_while_sampling_keeps_versions_apart(
    core: RolloutCore, adapters: dict[int, Path], model_dir: Path, tmp_path: Path
) -> None:
    await push(core, "reg-a", 1, adapters[1], tmp_path)
    await push(core, "reg-b", 1, adapters[4], tmp_path)
    on_v1 = asyncio.ensure_future(core.sample("reg-a", 1, greedy(120)))
    await wait_until_async(lambda: core.registry.resident["reg-a@1"].in_flight, "v1 pinned")

    assert await push(core, "reg-a", 2, adapters[2], tmp_path) == ("reg-a@2", False)
    v2 = await core.sample("reg-a", 2, greedy(8))
    other = await core.sample("reg-b", 1, greedy(8))  # other adapters keep being served
    assert not on_v1.done()  # ... while the v1 sample is still running

    assert await push(core, "reg-a", 3, adapters[3], tmp_path) == ("reg-a@3", False)
    # A newer version retires no older one: a snapshot sampler keeps its weights.
    again = await core.sample("reg-a", 1, greedy(8))
    await core.unload_adapter("reg-a", 1)  # the controller collected it: nothing holds it
    with pytest.raises(NotFound) as collected:
        await core.sample("reg-a", 1, greedy(4))
    assert collected.value.field == "adapter.version"
    assert "reg-a@1" in [r.adapter_id for r in core.list_adapters()]  # still draining

    v1 = await on_v1
    assert list(v1.sequences[0].tokens) == reference_greedy(
        reference_model(model_dir, adapters[1]), list(PROMPT), 120
    )
    assert list(again.sequences[0].tokens) == list(v1.sequences[0].tokens)[:8]
    for result, source in ((v2, adapters[2]), (other, adapters[4])):
        assert list(result.sequences[0].tokens) == reference_greedy(
            reference_model(model_dir, source), list(PROMPT), 8
        )
    await upkeep(core)  # the idle retiring version is dropped in the background
    assert [r.adapter_id for r in core.list_adapters()] == ["reg-a@2", "reg-a@3", "reg-b@1"]


async def test_retired_registration_is_refused_after_reuse(
    core: RolloutCore, adapters: dict[int, Path], tmp_path: Path
) -> None:
    await push(core, "reg-old", 1, adapters[1], tmp_path)
    await core.unload_adapter("reg-old", 0)  # the registration is retired for good
    await push(core, "reg-new", 1, adapters[2], tmp_path)  # a new tenant (same trainer slot)
    with pytest.raises(NotFound) as refused:
        await core.sample("reg-old", 1, greedy(4))
    assert refused.value.field == "adapter.registration_id" and refused.value.reason == "RETIRED"
    with pytest.raises(FailedPrecondition):
        await push(core, "reg-old", 2, adapters[1], tmp_path)
    assert len((await core.sample("reg-new", 1, greedy(4))).sequences[0].tokens) == 4
    await core.unload_adapter("reg-old", 0)  # idempotent


async def test_load_is_idempotent_and_verified(
    core: RolloutCore, adapters: dict[int, Path], tmp_path: Path
) -> None:
    assert await push(core, "reg-a", 1, adapters[1], tmp_path) == ("reg-a@1", False)
    assert await push(core, "reg-a", 1, adapters[1], tmp_path) == ("reg-a@1", True)
    with pytest.raises(Conflict):
        await push(core, "reg-a", 1, adapters[2], tmp_path)

    staged = tmp_path / "tampered"
    shutil.copytree(adapters[3], staged)
    digests = file_digests(adapters[3])
    with (staged / "adapter_model.safetensors").open("r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01")
    with pytest.raises(InvalidArgument) as bad:
        await core.load_adapter("reg-c", 1, LORA, staged, digests)
    assert bad.value.field == "header.file_sha256[adapter_model.safetensors]"
    assert [r.adapter_id for r in core.list_adapters()] == ["reg-a@1"]


async def test_more_adapters_than_the_engine_holds_are_served_exactly(
    core: RolloutCore, model_dir: Path, tmp_path: Path
) -> None:
    """Eight tenants on an engine of four: every publish and sample succeeds, each evicted
    version loads again with the tokens of its own PEFT reference, in any order."""
    sources = {i: make_adapter(model_dir, tmp_path / f"many{i}", seed=10 + i) for i in range(8)}
    for i, source in sources.items():
        assert await push(core, f"reg-{i}", 1, source, tmp_path) == (f"reg-{i}@1", False)
    assert len(core.list_adapters()) == 8
    assert core.registry.loaded_count() == 4  # the engine holds the four most recent
    expected = {
        i: reference_greedy(reference_model(model_dir, source), list(PROMPT), 6)
        for i, source in sources.items()
    }
    first = {i: (await core.sample(f"reg-{i}", 1, greedy(6))) for i in sources}
    again = {}
    for i in (5, 0, 7, 2, 2, 6, 1, 3, 4, 0):
        again[i] = await core.sample(f"reg-{i}", 1, greedy(6))
    for i, result in [*first.items(), *again.items()]:
        assert list(result.sequences[0].tokens) == expected[i], i
    for i in again:
        assert again[i].sequences[0].logprobs == first[i].sequences[0].logprobs  # bit-identical
    assert core.registry.loaded_count() == 4
    # A publish identical to a held version is acknowledged even while it is evicted.
    evicted = next(r for r in core.list_adapters() if not r.loaded)
    source = sources[int(evicted.registration_id.split("-")[1])]
    assert await push(core, evicted.registration_id, 1, source, tmp_path) == (
        evicted.adapter_id,
        True,
    )


async def test_a_tenant_with_many_adapters_evicts_its_own_not_anothers_hot_set(
    core: RolloutCore, adapters: dict[int, Path], tmp_path: Path
) -> None:
    """Fair share of the engine's slots: "small" keeps two adapters hot while "big" cycles
    through eight on an engine of four. Plain LRU would evict small's pair on every pass of
    big's cycle; by tenant, big evicts its own and small's samples never load again."""

    async def push_for(tenant: str, reg: str, folder: Path) -> None:
        staged = tmp_path / f"staged-{reg}"
        shutil.copytree(folder, staged)
        await core.load_adapter(reg, 1, LORA, staged, file_digests(folder), tenant=tenant)

    for i in (1, 2):
        await push_for("small", f"small-{i}", adapters[i])
    for i in range(8):
        await push_for("big", f"big-{i}", adapters[1 + i % 4])
    held = {r.adapter_id: r.tenant for r in core.list_adapters() if r.loaded}
    assert sorted(held.values()) == ["big", "big", "small", "small"], held
    small_first = {i: await core.sample(f"small-{i}", 1, greedy(4)) for i in (1, 2)}
    loads_before = loads_by("sample")
    for rnd in range(2):
        for i in range(8):
            await core.sample(f"big-{i}", 1, greedy(2))
            small = 1 + (i + rnd) % 2  # small's hot pair, used between big's samples
            again = await core.sample(f"small-{small}", 1, greedy(4))
            assert again.sequences == small_first[small].sequences
    # Every one of big's 16 samples loads (eight adapters cycling through its two slots);
    # none of small's does.
    assert loads_by("sample") - loads_before == 16
    assert core.registry.resident["small-1@1"].loaded
    assert core.registry.resident["small-2@1"].loaded
    await upkeep(core)


async def test_32_requests_on_32_adapters_cost_at_most_1_25x_of_32_on_one(
    model_dir: Path, tmp_path: Path
) -> None:
    """Issue 35's serving figure, in CI: 32 concurrent requests on 32 distinct adapters (ranks
    4, 8 and 16, all loaded) run at >= 0.8 of the same 32 on one adapter. Measured in CPU
    seconds of this process (the engine's thread included), alternating the two sides over
    five rounds and taking the median ratio: a loaded machine slows both sides' wall time,
    not the work each costs."""
    limits = Limits(max_loaded_adapters=32, max_queued_requests=64, max_num_samples=1)
    core = RolloutCore(TorchEngine(model_dir), limits, tmp_path / "resident")
    await core.start()
    spec = SamplingSpec(16, temperature=0.0, disable_eos_stop=True)
    try:
        for i in range(32):
            rank = (4, 8, 16)[i % 3]
            folder = make_adapter(model_dir, tmp_path / f"src{i}", seed=i, rank=rank)
            staged = tmp_path / f"staged{i}"
            shutil.copytree(folder, staged)
            await core.load_adapter(
                f"reg-{i}", 1, LoraSpec(rank, 2 * rank), staged, file_digests(folder)
            )
        assert core.registry.loaded_count() == 32

        async def cpu_per_token(regs: list[int]) -> float:
            started = time.process_time()
            await asyncio.gather(
                *(
                    core.sample(f"reg-{r}", 1, SampleRequest(None, (3 + n, *PROMPT), spec))
                    for n, r in enumerate(regs)
                )
            )
            return (time.process_time() - started) / (len(regs) * 16)

        await cpu_per_token(list(range(32)))  # warm both paths
        await cpu_per_token([0] * 32)
        ratios = []
        for _ in range(5):
            one = await cpu_per_token([0] * 32)
            distinct = await cpu_per_token(list(range(32)))
            ratios.append(one / distinct)
        assert statistics.median(ratios) >= 0.8, ratios
    finally:
        await core.close()


async def test_waiting_for_room_and_for_a_load(
    core: RolloutCore, adapters: dict[int, Path], tmp_path: Path
) -> None:
    """With every engine slot pinned by a running request, samples of a fifth version wait
    (never fail) and run once one goes idle, evicting that one; three requests on one evicted
    version load it once."""
    for i in range(5):
        await push(core, f"reg-{i}", 1, adapters[1 + i % 4], tmp_path)
    loaded = sorted(r.registration_id for r in core.list_adapters() if r.loaded)
    cold = next(r.registration_id for r in core.list_adapters() if not r.loaded)
    pins = [core.registry.acquire(reg, 1) for reg in loaded]  # as running requests would
    loads_before = loads_by("sample")
    waiting = [asyncio.ensure_future(core.sample(cold, 1, greedy(4))) for _ in range(3)]
    await wait_until_async(lambda: core._waiting == 3, "three cold requests waiting for room")
    assert not any(w.done() for w in waiting) and loads_by("sample") == loads_before
    core._release(pins[1])  # one running request finishes: its version is the one evicted
    results = await asyncio.gather(*waiting)
    assert all(r.sequences == results[0].sequences for r in results)
    assert loads_by("sample") - loads_before == 1  # three requests, one load
    assert core.registry.resident[f"{cold}@1"].loaded
    assert not core.registry.resident[f"{loaded[1]}@1"].loaded
    assert core.registry.loaded_count() == 4
    for pin in (pins[0], *pins[2:]):
        core._release(pin)
    await upkeep(core)


async def test_superseded_while_waiting_for_a_load_is_refused(
    core: RolloutCore, adapters: dict[int, Path], tmp_path: Path
) -> None:
    """A retired version that was evicted is never loaded again, not even for a request that
    pinned it before the retirement."""
    for i in range(5):
        await push(core, f"reg-{i}", 1, adapters[1 + i % 4], tmp_path)
    loaded = sorted(r.registration_id for r in core.list_adapters() if r.loaded)
    cold = next(r.registration_id for r in core.list_adapters() if not r.loaded)
    pins = [core.registry.acquire(reg, 1) for reg in loaded]  # as running requests would
    waiting = asyncio.ensure_future(core.sample(cold, 1, greedy(4)))
    await wait_until_async(lambda: core._waiting, "the cold request waiting for room")
    await core.unload_adapter(cold, 0)
    with pytest.raises(NotFound) as refused:
        await waiting
    assert refused.value.reason == "VERSION_NOT_RESIDENT"
    for pin in pins:
        core._release(pin)
    await upkeep(core)
    assert cold not in {r.registration_id for r in core.list_adapters()}


async def test_stored_versions_are_bounded(model_dir: Path, tmp_path: Path) -> None:
    """Past max_stored_adapters the least recently used idle version leaves the replica; a
    request for it gets VERSION_NOT_RESIDENT (the controller pushes it again)."""
    limits = Limits(max_loaded_adapters=2, max_stored_adapters=3, max_queued_requests=8)
    c = RolloutCore(TorchEngine(model_dir), limits, tmp_path / "resident")
    await c.start()
    try:
        sources = {i: make_adapter(model_dir, tmp_path / f"s{i}", seed=20 + i) for i in range(4)}
        for i in range(3):
            await push(c, f"reg-{i}", 1, sources[i], tmp_path)
        await c.sample("reg-0", 1, greedy(2))  # reg-1 is now the least recently used
        await push(c, "reg-3", 1, sources[3], tmp_path)
        assert [r.adapter_id for r in c.list_adapters()] == ["reg-0@1", "reg-2@1", "reg-3@1"]
        assert len(list((tmp_path / "resident").iterdir())) == 3  # its files went with it
        with pytest.raises(NotFound) as gone:
            await c.sample("reg-1", 1, greedy(2))
        assert gone.value.reason == "VERSION_NOT_RESIDENT"
        await push(c, "reg-1", 1, sources[1], tmp_path)  # pushed again, it serves
        assert len((await c.sample("reg-1", 1, greedy(2))).sequences[0].tokens) == 2
    finally:
        await c.close()


async def test_queue_is_bounded(core: RolloutCore, adapters: dict[int, Path], tmp_path: Path):
    await push(core, "reg-1", 1, adapters[1], tmp_path)
    running = [asyncio.ensure_future(core.sample("reg-1", 1, greedy(60))) for _ in range(8)]
    await asyncio.sleep(0)
    with pytest.raises(ResourceExhausted) as queued:
        await core.sample("reg-1", 1, greedy(4))
    assert queued.value.retry_after > 0
    await asyncio.gather(*running)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (SampleRequest(None, (5, 10**6)), "prompt_tokens[1]"),
        (SampleRequest(None, (5, -1)), "prompt_tokens[1]"),
        (SampleRequest(None, PROMPT, SamplingSpec(max_tokens=10**6)), "params.max_tokens"),
        (SampleRequest(None, PROMPT, SamplingSpec(temperature=-1.0)), "params.temperature"),
        (SampleRequest(None, PROMPT, SamplingSpec(temperature=float("nan"))), "params.temperature"),
        (SampleRequest(None, PROMPT, SamplingSpec(top_p=1.5)), "params.top_p"),
        (SampleRequest(None, PROMPT, SamplingSpec(top_p=float("inf"))), "params.top_p"),
        (SampleRequest(None, PROMPT, SamplingSpec(top_k=-2)), "params.top_k"),
        (SampleRequest(None, PROMPT, num_samples=5), "num_samples"),
        (SampleRequest(None, ()), "prompt_tokens"),
    ],
)
async def test_bad_requests_name_the_field_and_the_engine_keeps_serving(
    core: RolloutCore, request_: SampleRequest, field: str
) -> None:
    with pytest.raises(InvalidArgument) as bad:
        await core.sample("", 0, request_)
    assert bad.value.field == field
    with pytest.raises(NotFound):
        await core.sample("reg-unknown", 1, greedy(2))
    assert len((await core.sample("", 0, greedy(3))).sequences[0].tokens) == 3


@pytest.mark.parametrize(("num_samples", "temperature"), [(1, 0.0), (3, 1.0)])
async def test_topk_prompt_logprobs_imply_the_flat_ones(
    core: RolloutCore, model_dir: Path, num_samples: int, temperature: float
) -> None:
    spec = SamplingSpec(3, temperature=temperature, seed=7, disable_eos_stop=True)
    asked = await core.sample(
        "", 0, SampleRequest(None, PROMPT, spec, num_samples, topk_prompt_logprobs=4)
    )
    assert len(asked.sequences) == num_samples
    assert len(asked.prompt_logprobs) == len(asked.topk_prompt_logprobs) == len(PROMPT)
    assert math.isnan(asked.prompt_logprobs[0]) and asked.topk_prompt_logprobs[0] == ()
    expected = reference_logprobs(reference_model(model_dir, None), list(PROMPT))
    assert (torch.tensor(asked.prompt_logprobs[1:]) - expected).abs().max() <= 1e-4
    for t, row in enumerate(asked.topk_prompt_logprobs[1:], start=1):
        assert len(row) == 4 and row[0][1] >= asked.prompt_logprobs[t] - 1e-6

    plain = await core.sample("", 0, SampleRequest(None, PROMPT, spec, num_samples))
    assert plain.prompt_logprobs == () and plain.topk_prompt_logprobs == ()


async def test_eviction_prefers_the_incoming_adapters_rank_class_among_the_oldest(
    model_dir: Path, tmp_path: Path
) -> None:
    """With the torch engine's rank classes, making room for an adapter evicts the oldest
    idle one of its class when that is in the least recently used third, so the class's
    slot is reused (no resize, no hole elsewhere); outside that third, plain LRU. A class
    left more than an eighth empty is compacted."""
    engine = TorchEngine(model_dir, max_batch_size=8)
    core = RolloutCore(engine, Limits(max_loaded_adapters=6, max_queued_requests=8), tmp_path)
    await core.start()
    try:
        ranks = [4, 4, 8, 4, 4, 4, 8, 8]
        for i, rank in enumerate(ranks):
            folder = make_adapter(model_dir, tmp_path / f"src{i}", seed=50 + i, rank=rank)
            staged = tmp_path / f"staged{i}"
            shutil.copytree(folder, staged)
            lora = LoraSpec(rank, 2 * rank)
            await core.load_adapter(f"r{i}", 1, lora, staged, file_digests(folder))

        def loaded() -> list[str]:
            return sorted(r.registration_id for r in core.list_adapters() if r.loaded)

        # r0..r5 filled the six slots (r2 the only rank 8). r6 (rank 8) evicted r0: no rank
        # 8 among the oldest third (r0, r1). r7 (rank 8) evicted r2, the rank 8 in the
        # oldest third (r1, r2), not r1: class 8 reuses r2's slot.
        assert loaded() == ["r1", "r3", "r4", "r5", "r6", "r7"]
        slots = engine._model()
        assert slots.capacity == {4: 5, 8: 2}
        await core.sample("r2", 1, greedy(4))  # no rank 8 among r1, r3: evicts r1
        assert loaded() == ["r2", "r3", "r4", "r5", "r6", "r7"]
        assert slots.capacity == {4: 3, 8: 3}  # class 4 held 3 of 5: compacted
        await core.sample("r1", 1, greedy(4))  # r3, rank 4, the oldest: its slot reused
        assert loaded() == ["r1", "r2", "r4", "r5", "r6", "r7"]
        assert slots.capacity == {4: 3, 8: 3}
    finally:
        await core.close()
