"""Deployment limits come from what the replicas announce, not from constants.

A rollout configured for at most 3 samples per request makes a 4-sample request a 400 naming
`num_samples` when it is submitted (not a late failure of the operation), and 3 are served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

from lorafleet.testing import wait_until

LIMIT = 3


@pytest.fixture(scope="module")
def fleet(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    rollout_env = {"LORAFLEET_ROLLOUT_MAX_NUM_SAMPLES": str(LIMIT)}
    with make_fleet(trainers=1, rollouts=1, slots=1, extra_env={"rollout": rollout_env}) as f:
        yield f


def test_num_samples_is_bounded_by_the_rollouts_setting(fleet: object) -> None:
    base_url, key = fleet.base_url, fleet.api_key  # type: ignore[attr-defined]
    with httpx.Client(base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=60) as c:
        caps = c.get("/get_server_capabilities").json()["supported_models"]
        base = next(m["model_name"] for m in caps if m["sampleable"])
        session = c.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()
        sampler = c.post(
            "/create_sampling_session",
            json={
                "session_id": session["session_id"],
                "sampling_session_seq_id": 0,
                "base_model": base,
            },
        ).json()["sampling_session_id"]

        def sample(n: int, seq: int) -> httpx.Response:
            body = {
                "sampling_session_id": sampler,
                "seq_id": seq,
                "num_samples": n,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                "sampling_params": {"max_tokens": 1, "temperature": 1.0},
            }
            return c.post("/asample", json=body)

        refused = sample(LIMIT + 1, 1)
        assert refused.status_code == 400, refused.text
        assert refused.json()["field"] == "num_samples", refused.json()
        assert f"[1, {LIMIT}]" in refused.json()["detail"], refused.json()

        accepted = sample(LIMIT, 2)
        assert accepted.status_code == 200, accepted.text
        request_id = accepted.json()["request_id"]

        def answered() -> dict | None:
            reply = c.post("/retrieve_future", json={"request_id": request_id}).json()
            return None if reply.get("type") == "try_again" else reply

        result = wait_until(answered, "the sample finished")
        assert result["type"] == "sample" and len(result["sequences"]) == LIMIT, result
