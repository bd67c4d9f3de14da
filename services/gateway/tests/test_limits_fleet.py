"""Deployment limits come from what the replicas announce, not from constants; admission
limits refuse one tenant, not the fleet.

A rollout configured for at most 3 samples per request makes a 4-sample request a 400 naming
`num_samples` when it is submitted (not a late failure of the operation), and 3 are served.
A forward_backward over the gateway's row or token cap is a 400 naming `data`. A tenant
flooding large forward_backward payloads it never retrieves is refused with 429s naming a
byte limit (issue 36 item 3) while another tenant's steps go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import httpx
import pytest

from lorafleet.testing import wait_until

LIMIT = 3
MAX_ROWS, MAX_TOKENS = 8, 2048
# Small enough that a few large payloads and their results reach them.
BYTE_LIMIT = 16 * 1024


@pytest.fixture(scope="module")
def fleet(make_fleet: Callable[..., AbstractContextManager[object]]) -> Iterator[object]:
    rollout_env = {"LORAFLEET_ROLLOUT_MAX_NUM_SAMPLES": str(LIMIT)}
    gateway_env = {
        "LORAFLEET_GATEWAY_MAX_ROWS_PER_OPERATION": str(MAX_ROWS),
        "LORAFLEET_GATEWAY_MAX_TOKENS_PER_OPERATION": str(MAX_TOKENS),
    }
    controller_env = {
        "LORAFLEET_CONTROLLER_MAX_PENDING_BYTES_PER_TENANT": str(4 * BYTE_LIMIT),
        "LORAFLEET_CONTROLLER_MAX_UNACKED_BYTES_PER_TENANT": str(BYTE_LIMIT),
    }
    extra_env = {"rollout": rollout_env, "gateway": gateway_env, "controller": controller_env}
    with make_fleet(trainers=1, rollouts=1, slots=2, extra_env=extra_env) as f:
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


class Tenant:
    """One tenant's HTTP client, with a training run of its own. Like the SDKs, it
    heartbeats its session every 10 s while it works: a client silent for
    `SESSION_TIMEOUT_SECONDS` (120 s) is finished, and on a loaded machine the flood below
    can take that long."""

    HEARTBEAT_SECONDS = 10.0

    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(
            base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=60
        )
        base = next(
            m["model_name"]
            for m in self.http.get("/get_server_capabilities").json()["supported_models"]
            if m["trainable"]
        )
        session = self.http.post("/create_session", json={"tags": [], "sdk_version": "t"}).json()
        created = self.http.post(
            "/create_model",
            json={
                "session_id": session["session_id"],
                "model_seq_id": 0,
                "base_model": base,
                "lora_config": {"rank": 4},
            },
        )
        assert created.status_code == 200, created.text
        self.session_id = session["session_id"]
        self.beat_at = time.monotonic()
        self.model_id = created.json()["model_id"]
        self.result(created.json()["request_id"])
        self.seq = 0

    def heartbeat(self) -> None:
        """Heartbeat the session when the last one is 10 s old."""
        if time.monotonic() - self.beat_at < self.HEARTBEAT_SECONDS:
            return
        beat = self.http.post("/session_heartbeat", json={"session_id": self.session_id})
        assert beat.status_code == 200, beat.text
        self.beat_at = time.monotonic()

    def forward_backward(self, rows: int, tokens: int, again: bool = False) -> httpx.Response:
        """The next seq_id's forward_backward (`again`: the last one's, retried): `rows`
        rows of `tokens` tokens each."""
        self.seq += 0 if again else 1
        datum = {
            "model_input": {"chunks": [{"type": "encoded_text", "tokens": [5] * tokens}]},
            "loss_fn_inputs": {
                "target_tokens": {"data": [6] * tokens, "dtype": "int64"},
                "weights": {"data": [1.0] * tokens, "dtype": "float32"},
            },
        }
        body = {"loss_fn": "cross_entropy", "data": [datum] * rows}
        self.heartbeat()
        return self.http.post(
            "/forward_backward",
            json={"forward_backward_input": body, "model_id": self.model_id, "seq_id": self.seq},
        )

    def result(self, request_id: str) -> dict:
        def answered() -> dict | None:
            self.heartbeat()
            reply = self.http.post("/retrieve_future", json={"request_id": request_id}).json()
            return None if reply.get("type") == "try_again" else reply

        return wait_until(answered, f"{request_id} finished")


def test_one_operation_over_the_row_or_token_cap_is_a_400_naming_data(fleet: object) -> None:
    tenant = Tenant(fleet.base_url, fleet.api_key)  # type: ignore[attr-defined]
    for rows, tokens in ((MAX_ROWS + 1, 4), (8, MAX_TOKENS // 8 + 1)):
        refused = tenant.forward_backward(rows, tokens)
        assert refused.status_code == 400, refused.text
        assert refused.json()["field"] == "forward_backward_input.data", refused.json()
    within = tenant.forward_backward(MAX_ROWS, MAX_TOKENS // MAX_ROWS)
    assert within.status_code == 200, within.text
    assert "loss_fn_outputs" in tenant.result(within.json()["request_id"])


def test_a_flood_of_large_payloads_gets_429s_while_another_tenant_steps(fleet: object) -> None:
    """The flooding tenant submits 500-token payloads (about 7 KiB each) and never
    retrieves a result: its unacknowledged result bytes (or its open payload bytes, when
    the trainer falls behind) reach their limit and it is refused with backpressure naming
    it, while the other tenant's forward_backward steps are admitted and answered."""
    flood = Tenant(fleet.base_url, fleet.create_api_key("flood", "test"))  # type: ignore[attr-defined]
    other = Tenant(fleet.base_url, fleet.api_key)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 120
    refused = None
    while refused is None:
        assert time.monotonic() < deadline, "the flood was never refused"
        reply = flood.forward_backward(1, 500)
        if reply.status_code == 429:
            refused = reply
        else:
            assert reply.status_code == 200, reply.text
            assert flood.seq < 200, "200 large payloads admitted: no byte limit held"
    body = refused.json()
    assert body["reason"] == "BACKPRESSURE", body
    assert "BYTES_PER_TENANT" in body["detail"], body
    assert int(refused.headers["Retry-After"]) >= 1
    for _ in range(3):  # three steps of the other tenant, each awaited to its result
        step = other.forward_backward(1, 4)
        assert step.status_code == 200, step.text
        assert "loss_fn_outputs" in other.result(step.json()["request_id"])
    # Retried (the SDK retries the same seq_id): still refused, as nothing was written.
    again = flood.forward_backward(1, 500, again=True)
    assert again.status_code == 429, again.text
