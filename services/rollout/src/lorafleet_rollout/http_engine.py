"""What the HTTP-driven engines (SGLang, vLLM) share: waiting for health and reading limits.

Both drive an external server they did not load, so readiness means "its health route
answers 200" and the limits come from the base model's config, not from the server.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx
from tenacity import (
    AsyncRetrying,
    RetryError,
    retry_if_exception_type,
    stop_after_delay,
    wait_fixed,
)
from transformers import AutoConfig

from lorafleet.errors import Unavailable
from lorafleet_rollout.types import EngineInfo


class _NotHealthy(Exception):
    """The health route did not answer 200 yet (retried until the deadline)."""


async def wait_healthy(
    client: httpx.AsyncClient,
    route: str,
    *,
    name: str,
    url: str,
    ready_timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll `route` once a second until it answers 200; fail early if `proc` (a server this
    engine launched) exits, and with Unavailable after `ready_timeout` seconds."""

    async def probe() -> None:
        if proc is not None and proc.poll() is not None:
            raise Unavailable(f"the {name} server exited with {proc.returncode}")
        try:
            if (await client.get(route, timeout=5.0)).status_code == 200:
                return
        except httpx.TransportError as exc:
            raise _NotHealthy(str(exc)) from exc
        raise _NotHealthy(route)

    try:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(_NotHealthy),
            wait=wait_fixed(1.0),
            stop=stop_after_delay(ready_timeout),
        ):
            with attempt:
                await probe()
    except RetryError:
        raise Unavailable(f"{name} at {url} is not healthy") from None


async def engine_info(engine: str, model_path: Path | str, max_lora_rank: int) -> EngineInfo:
    """EngineInfo for a server serving `model_path`, limits read from its config."""
    config = await asyncio.to_thread(AutoConfig.from_pretrained, str(model_path))
    return EngineInfo(
        engine=engine,
        base_model=str(model_path),
        max_context_length=int(config.max_position_embeddings),
        vocab_size=int(config.vocab_size),
        max_lora_rank=max_lora_rank,
    )
