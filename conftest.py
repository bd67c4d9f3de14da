"""Fixtures shared by every test: free ports, a private redis-server, the tiny model, whole
fleets on it, and the real-SDK venvs."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import pytest

from lorafleet.testing import (
    RedisClusterNodes,
    RedisServer,
    free_port,
    start_redis,
    start_redis_cluster,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests skip themselves without CUDA; `sglang` tests without SGLANG_URL."""
    cuda = None
    for item in items:
        if "gpu" in item.keywords:
            cuda = _has_cuda() if cuda is None else cuda
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "sglang" in item.keywords and not os.environ.get("SGLANG_URL"):
            item.add_marker(pytest.mark.skip(reason="needs a real SGLang server (SGLANG_URL)"))


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A private redis-server on a free loopback port, stopped by its PID afterwards."""
    server = start_redis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisClusterNodes]:
    """A private 3-master Redis Cluster on free loopback ports, stopped by PID afterwards."""
    cluster = start_redis_cluster(tmp_path / "redis-cluster", masters=3)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The ~1M-parameter tiny model + tokenizer, built once per machine from its seed."""
    from lorafleet_models.tiny import ensure_model

    return ensure_model("tiny", REPO / ".cache" / "models")


@pytest.fixture(scope="session")
def make_fleet(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., AbstractContextManager[object]]:
    """make_fleet(**FleetConfig fields) → a Fleet on the tiny model in a fresh run folder, to
    enter with `with`: one place that knows how tests start a whole fleet."""
    from lorafleet_cli.fleet import Fleet, FleetConfig

    def make(**config: object) -> Fleet:
        run_dir = tmp_path_factory.mktemp("fleet")
        return Fleet(FleetConfig(model_path=tiny_model_dir, run_dir=run_dir, **config))

    return make


@pytest.fixture(scope="session")
def shared_fleet(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    """One whole fleet on the tiny model (Redis, controller, trainer, rollout, gateway) for
    every end-to-end test that does not need a fleet of its own. Tests using it must not
    assume they are alone: each creates its own session and training runs."""
    with make_fleet(slots=8) as fleet:
        yield fleet


@pytest.fixture(scope="session")
def sdk_python() -> Callable[[str], Path]:
    """sdk_python("0.38.0") → that tinker venv's python, or skip with the command that builds
    it (the venvs come from tests/sdk/setup_venvs.sh)."""

    def find(version: str) -> Path:
        python = REPO / ".venvs" / f"tinker-{version}" / "bin" / "python"
        if not python.exists():
            pytest.skip(f"no tinker {version} venv: run tests/sdk/setup_venvs.sh")
        return python

    return find
