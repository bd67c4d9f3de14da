"""The gateway over HTTP against a real fleet: auth, tenancy, bad input, futures, metrics.

Every bad request must be a 4xx whose body names the field, and must change nothing: after
the rejections the model still answers exactly as before.
"""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import zstandard

from lorafleet.contract import FutureId
from lorafleet.testing import wait_until
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet.v1 import controller_pb2_grpc
from lorafleet_gateway.tinker_proto import tinker_public_pb2 as tpb

PROTO = "application/x-protobuf"


class Client:
    def __init__(self, base_url: str, key: str) -> None:
        self.http = httpx.Client(
            base_url=f"{base_url}/api/v1", headers={"X-API-Key": key}, timeout=60
        )

    def post(self, path: str, body: object = None, **kw: object) -> httpx.Response:
        return (
            self.http.post(path, json=body, **kw)
            if body is not None
            else self.http.post(path, **kw)
        )

    def result(self, request_id: str, accept: str = "application/json") -> httpx.Response:
        """Poll retrieve_future until it is no longer try_again."""

        def answered() -> httpx.Response | None:
            reply = self.post(
                "/retrieve_future", {"request_id": request_id}, headers={"Accept": accept}
            )
            if reply.headers["content-type"].startswith(PROTO):
                return reply
            if reply.status_code != 200 or reply.json().get("type") != "try_again":
                return reply
            return None

        return wait_until(answered, f"{request_id} finished")


@pytest.fixture(scope="module")
def client(fleet: object) -> Client:
    return Client(fleet.base_url, fleet.api_key)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def model(client: Client) -> dict:
    caps = client.http.get("/get_server_capabilities").json()["supported_models"]
    base = next(m["model_name"] for m in caps if m["trainable"])
    session = client.post("/create_session", {"tags": [], "sdk_version": "test"}).json()
    created = client.post(
        "/create_model",
        {
            "session_id": session["session_id"],
            "model_seq_id": 0,
            "base_model": base,
            "lora_config": {"rank": 4},
        },
    )
    assert created.status_code == 200, created.text
    model_id = created.json()["model_id"]
    assert client.result(created.json()["request_id"]).json()["model_id"] == model_id
    return {"model_id": model_id, "session_id": session["session_id"], "seq": 0}


TOKENS = [5, 6, 7, 8]


def fb_body(model: dict, seq: int, **over: object) -> dict:
    datum = {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]},
        "loss_fn_inputs": {
            "target_tokens": {"data": [6, 7, 8, 9], "dtype": "int64"},
            "weights": {"data": [1.0] * 4, "dtype": "float32"},
        },
    }
    body = {"loss_fn": "cross_entropy", "data": [datum]}
    body.update(over)
    return {"forward_input": body, "model_id": model["model_id"], "seq_id": seq}


def next_seq(model: dict) -> int:
    model["seq"] += 1
    return model["seq"]


def forward_logprobs(client: Client, model: dict) -> list[float]:
    reply = client.post("/forward", fb_body(model, next_seq(model)))
    assert reply.status_code == 200, reply.text
    out = client.result(reply.json()["request_id"]).json()
    return out["loss_fn_outputs"][0]["logprobs"]["data"]


def assert_400(reply: httpx.Response, field: str, status: int = 400) -> None:
    assert reply.status_code == status, reply.text
    assert reply.json()["field"] == field, reply.json()


def test_auth_is_required_and_checked(fleet: object) -> None:
    base = f"{fleet.base_url}/api/v1"  # type: ignore[attr-defined]
    assert httpx.get(f"{base}/training_runs").status_code == 401
    wrong = httpx.get(f"{base}/training_runs", headers={"X-API-Key": "tml-nope"})
    assert_400(wrong, "X-API-Key", 401)
    unknown = httpx.get(f"{base}/no/such/route")
    assert unknown.status_code == 404 and unknown.json()["detail"] == "Not Found"


def test_bad_input_is_4xx_naming_the_field_and_changes_nothing(client: Client, model: dict) -> None:
    before = forward_logprobs(client, model)
    seq = model["seq"] + 1  # every rejected request below uses the next, still unspent seq_id
    assert_400(
        client.post("/forward", content=b"{not json", headers={"Content-Type": "application/json"}),
        "body",
    )
    bad_shape = fb_body(model, seq)
    bad_shape["forward_input"]["data"][0]["loss_fn_inputs"]["weights"]["shape"] = [5]
    assert_400(
        client.post("/forward", bad_shape), "forward_input.data[0].loss_fn_inputs.weights.shape"
    )
    assert_400(
        client.post("/forward", fb_body(model, seq, loss_fn="nope")), "forward_input.loss_fn"
    )
    wrong_type = fb_body(model, seq)
    wrong_type["forward_input"]["data"][0]["model_input"]["chunks"][0]["tokens"] = ["a"]
    assert_400(
        client.post("/forward", wrong_type), "forward_input.data[0].model_input.chunks[0].tokens[0]"
    )
    nan_adam = json.dumps(
        {"model_id": model["model_id"], "seq_id": seq, "adam_params": {"learning_rate": math.nan}}
    )
    assert_400(
        client.post(
            "/optim_step", content=nan_adam.encode(), headers={"Content-Type": "application/json"}
        ),
        "adam_params.learning_rate",
    )
    garbage = client.post(
        "/forward_backward", content=b"\xff\xfe\xfd", headers={"Content-Type": PROTO}
    )
    assert_400(garbage, "body")
    bad_zstd = client.post(
        "/forward_backward",
        content=b"\x28\xb5\x2f\xfd junk",
        headers={"Content-Type": PROTO, "Content-Encoding": "zstd"},
    )
    assert_400(bad_zstd, "body")
    huge = client.post(
        "/forward", content=b" " * (2 << 20), headers={"Content-Type": "application/json"}
    )
    assert_400(huge, "body", 413)
    # The first refusal that named (model_id, seq) spent that seq_id in the ledger, as the
    # SDK spent it: the run's next operation runs at once instead of waiting for a gap
    # timeout, and it computes exactly what it did before.
    model["seq"] = seq
    started = time.monotonic()
    assert forward_logprobs(client, model) == pytest.approx(before, abs=0)
    assert time.monotonic() - started < 30


def _proto_fb(model: dict, seq: int) -> bytes:
    req = tpb.ForwardBackwardRequest(
        model_id=model["model_id"], seq_id=seq, loss_fn="cross_entropy", forward_only=True
    )
    d = req.data.add()
    d.model_input.add().encoded_text.tokens = np.array(TOKENS, "<i4").tobytes()
    d.loss_fn_inputs["target_tokens"].CopyFrom(
        tpb.Tensor(dense=np.array([6, 7, 8, 9], "<i8").tobytes(), dtype=tpb.DTYPE_INT64, shape=[4])
    )
    d.loss_fn_inputs["weights"].CopyFrom(
        tpb.Tensor(dense=np.ones(4, "<f4").tobytes(), dtype=tpb.DTYPE_FLOAT32, shape=[4])
    )
    return req.SerializeToString()


def test_token_ids_and_lengths_are_checked_against_the_model(
    client: Client, model: dict, tiny_model_dir: Path
) -> None:
    """Limits that depend on the deployment come from capabilities (the trainer's vocabulary
    and positions): a 400 naming the SDK's field, JSON and protobuf alike, changing nothing."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    vocab, positions = config["vocab_size"], config["max_position_embeddings"]
    before = forward_logprobs(client, model)

    def out_of_vocab() -> httpx.Response | None:
        body = fb_body(model, next_seq(model))
        body["forward_input"]["data"][0]["model_input"]["chunks"][0]["tokens"] = [5, vocab, 7, 8]
        reply = client.post("/forward", body)
        # Admitted only while the gateway's cached capabilities predate the trainer's report:
        # the trainer refuses it then (the same validator), and the next seq_id tries again.
        return reply if reply.status_code == 400 else None

    refused = wait_until(out_of_vocab, "the gateway refuses a token id outside the vocabulary")
    assert_400(refused, "forward_input.data[0].model_input")
    assert "position 1" in refused.json()["detail"], refused.json()

    long = fb_body(model, next_seq(model))
    datum = long["forward_input"]["data"][0]
    datum["model_input"]["chunks"][0]["tokens"] = [5] * (positions + 1)
    datum["loss_fn_inputs"] = {"target_tokens": {"data": [6] * (positions + 1), "dtype": "int64"}}
    assert_400(client.post("/forward", long), "forward_input.data[0].model_input")

    request = tpb.ForwardBackwardRequest.FromString(_proto_fb(model, next_seq(model)))
    request.data[0].model_input[0].encoded_text.tokens = np.array([5, 6, 7, vocab], "<i4").tobytes()
    reply = client.post(
        "/forward_backward", content=request.SerializeToString(), headers={"Content-Type": PROTO}
    )
    assert_400(reply, "data[0].model_input")

    # A schema refusal names the field as the JSON has it, not pydantic's union member
    # ("...weights.data[0].int"), through FastAPI's parser and the gateway's own alike.
    typo = fb_body(model, next_seq(model))
    typo["forward_input"]["data"][0]["loss_fn_inputs"]["weights"]["data"] = ["x"] * 4
    weights = "data[0].loss_fn_inputs.weights.data[0]"
    assert_400(client.post("/forward", typo), f"forward_input.{weights}")
    typo["forward_backward_input"] = typo.pop("forward_input")
    typo["seq_id"] = next_seq(model)
    assert_400(client.post("/forward_backward", typo), f"forward_backward_input.{weights}")
    assert forward_logprobs(client, model) == pytest.approx(before, abs=0)


def test_proto_zstd_forward_returns_proto_and_json_results(client: Client, model: dict) -> None:
    json_lps = forward_logprobs(client, model)
    body = zstandard.ZstdCompressor().compress(_proto_fb(model, next_seq(model)))
    reply = client.post(
        "/forward_backward",
        content=body,
        headers={"Content-Type": PROTO, "Content-Encoding": "zstd"},
    )
    assert reply.status_code == 200, reply.text
    result = client.result(reply.json()["request_id"], accept=PROTO)
    assert result.headers["content-type"].startswith(PROTO), result.text
    out = tpb.ForwardBackwardOutput.FromString(result.content)
    lps = np.frombuffer(out.loss_fn_outputs[0].fields["logprobs"].data, "<f4").tolist()
    assert lps == pytest.approx(json_lps, abs=1e-6)
    assert math.isclose(out.metrics["loss:sum"], -sum(lps), rel_tol=1e-5)
    # The result is acknowledged after it was sent (a background task of that reply) and
    # released the controller's acked-result grace later (2 s here), so an answer lost in
    # transit is delivered again; once released, polling again is 410.
    request_id = reply.json()["request_id"]

    def acknowledged() -> bool:
        again = client.post("/retrieve_future", {"request_id": request_id})
        assert again.status_code in (200, 410), again.text
        return again.status_code == 410

    wait_until(acknowledged, f"{request_id} acknowledged")


def test_same_seq_id_with_another_payload_is_422(client: Client, model: dict) -> None:
    seq = next_seq(model)
    first = client.post("/forward", fb_body(model, seq))
    again = client.post("/forward", fb_body(model, seq))
    assert first.json()["request_id"] == again.json()["request_id"]  # a retry dedups
    other = fb_body(model, seq)
    other["forward_input"]["data"][0]["loss_fn_inputs"]["weights"]["data"] = [0.5] * 4
    assert client.post("/forward", other).status_code == 422
    assert client.result(first.json()["request_id"]).status_code == 200


def test_other_tenants_ids_are_404(fleet: object, client: Client, model: dict) -> None:
    key = fleet.create_api_key("intruder", "test")  # type: ignore[attr-defined]
    intruder = Client(fleet.base_url, key)  # type: ignore[attr-defined]
    assert intruder.post("/get_info", {"model_id": model["model_id"]}).status_code == 404
    assert intruder.http.get(f"/training_runs/{model['model_id']}").status_code == 404
    reply = intruder.post("/forward", fb_body(model, model["seq"] + 1))
    assert reply.status_code == 404, reply.text
    info = client.post("/get_info", {"model_id": model["model_id"]}).json()
    assert info["model_data"]["tokenizer_id"] and info["lora_rank"] == 4


def test_finished_session_heartbeat_is_410(client: Client) -> None:
    session = client.post("/create_session", {}).json()["session_id"]
    assert client.post("/session_heartbeat", {"session_id": session}).status_code == 200
    assert (
        client.post(f"/sessions/{session}/finish", {"reason": {"type": "success"}}).status_code
        == 200
    )
    assert client.post("/session_heartbeat", {"session_id": session}).status_code == 410


def test_metrics_use_route_templates(fleet: object, client: Client) -> None:
    client.http.get("/training_runs/some-id-that-does-not-exist")
    assert httpx.get(f"{fleet.base_url}/metrics").status_code == 404  # type: ignore[attr-defined]
    metrics_port = fleet.member("gateway").metrics_port  # type: ignore[attr-defined]
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
    assert 'route="/api/v1/training_runs/{run_id}"' in text
    assert "some-id-that-does-not-exist" not in text
    assert "lorafleet_http_request_seconds_bucket" in text


def test_every_route_has_a_body_limit_checked_before_auth(fleet: object) -> None:
    """A 52 MB telemetry upload without a key is refused from its Content-Length alone."""
    host, port = fleet.base_url.removeprefix("http://").split(":")  # type: ignore[attr-defined]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /api/v1/telemetry HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 52000000\r\n\r\n"
        )
        head = sock.recv(4096).decode()
    assert head.startswith("HTTP/1.1 413"), head
    small = httpx.post(
        f"{fleet.base_url}/api/v1/create_session",  # type: ignore[attr-defined]
        content=b" " * (100 << 10),
        headers={"Content-Type": "application/json", "X-API-Key": fleet.api_key},  # type: ignore[attr-defined]
    )
    assert_400(small, "body", 413)


def test_refusals_spend_their_seq_id_schema_stage_included(client: Client, model: dict) -> None:
    before = forward_logprobs(client, model)
    refused = [
        # refused by the schema (ttl_seconds must be >= 1)
        ("/save_weights", {"path": "ok", "ttl_seconds": 0}, "ttl_seconds"),
        # refused by the contract's name rule
        ("/save_weights", {"path": "my ckpt"}, "path"),
        (
            "/forward",
            {"forward_input": fb_body(model, 0, loss_fn="dimuon")["forward_input"]},
            "forward_input.loss_fn",
        ),
        # dimuon is what Tinker (0.38) names an optimizer: refused as one too (AdamW only)
        (
            "/optim_step",
            {
                "optimizer_params": {
                    "type": "dimuon",
                    "learning_rate": 1e-3,
                    "grad_clip_norm": 0.0,
                    "beta1": 0.9,
                }
            },
            "optimizer_params",
        ),
    ]
    for path, body, field in refused:
        seq = next_seq(model)
        reply = client.post(path, {"model_id": model["model_id"], "seq_id": seq, **body})
        assert_400(reply, field)
    created = client.post(
        "/create_model",
        {
            "session_id": model["session_id"],
            "model_seq_id": 99,
            "base_model": "any",
            "lora_config": {"rank": 4},
            "optimizer_config": {"type": "dimuon"},
        },
    )
    assert_400(created, "optimizer_config.type")
    assert "dimuon" in created.json()["detail"] and "adamw" in created.json()["detail"]
    # Each refusal spent its seq_id: the next operation runs at once, computing the same.
    started = time.monotonic()
    assert forward_logprobs(client, model) == pytest.approx(before, abs=0)
    assert time.monotonic() - started < 30


def test_unknown_checkpoint_routes_are_404(client: Client, model: dict) -> None:
    run = model["model_id"]
    for checkpoint_id in ("checkpoint-123", "weights/never-saved", "other/x"):
        reply = client.http.get(f"/training_runs/{run}/checkpoints/{checkpoint_id}/archive")
        assert reply.status_code == 404, (checkpoint_id, reply.status_code, reply.text)
    assert client.http.get(f"/training_runs/{run}/checkpoints/weights/nope").status_code == 404


def test_lora_options_from_user_metadata(fleet: object, client: Client, model: dict) -> None:
    caps = client.http.get("/get_server_capabilities").json()["supported_models"]
    base = next(m["model_name"] for m in caps if m["trainable"])
    body = {"session_id": model["session_id"], "base_model": base, "lora_config": {"rank": 2}}
    for seq, (metadata, field) in enumerate(
        [
            ({"lorafleet.alpha": "abc"}, "user_metadata.lorafleet.alpha"),
            ({"lorafleet.dropout": "1.5"}, "user_metadata.lorafleet.dropout"),
            ({"lorafleet.alphaa": "16"}, "user_metadata.lorafleet.alphaa"),
        ],
        start=10,
    ):
        reply = client.post(
            "/create_model", {**body, "model_seq_id": seq, "user_metadata": metadata}
        )
        assert_400(reply, field)
    metadata = {"lorafleet.alpha": "16", "lorafleet.target_modules": "q_proj,v_proj", "team": "a"}
    created = client.post("/create_model", {**body, "model_seq_id": 20, "user_metadata": metadata})
    assert created.status_code == 200, created.text
    run_id = created.json()["model_id"]
    run = client.http.get(f"/training_runs/{run_id}").json()
    assert run["user_metadata"] == {"team": "a"}  # options are not the user's metadata
    with fleet.admin_channel() as channel:  # type: ignore[attr-defined]
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        key = cpb.AuthenticateRequest(api_key=fleet.api_key)  # type: ignore[attr-defined]
        tenant = stub.Authenticate(key, timeout=10).tenant
        lookup = cpb.GetRegistrationRequest(tenant=tenant, registration_id=run_id)
        lora = stub.GetRegistration(lookup, timeout=10).registration.lora_config
    assert (lora.rank, lora.alpha, list(lora.target_modules)) == (2, 16.0, ["q_proj", "v_proj"])
    assert client.post("/unload_model", {"model_id": run_id}).status_code == 200


def test_asample_without_seq_id_twice(client: Client, model: dict) -> None:
    caps = client.http.get("/get_server_capabilities").json()["supported_models"]
    base = next(m["model_name"] for m in caps if m["sampleable"])
    sampler = client.post(
        "/create_sampling_session",
        {"session_id": model["session_id"], "sampling_session_seq_id": 0, "base_model": base},
    ).json()["sampling_session_id"]
    ids = []
    for tokens in ([5, 6], [7, 8, 9]):
        body = {
            "sampling_session_id": sampler,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": {"max_tokens": 2, "temperature": 0.0},
        }
        reply = client.post("/asample", body)
        assert reply.status_code == 200, reply.text
        ids.append(reply.json()["request_id"])
        assert client.result(ids[-1]).json()["type"] == "sample"
    assert ids[0] != ids[1]


def test_revoked_key_stops_working_within_a_second(fleet: object) -> None:
    with fleet.admin_channel() as channel:  # type: ignore[attr-defined]
        stub = controller_pb2_grpc.ControllerServiceStub(channel)
        created = stub.CreateApiKey(
            cpb.CreateApiKeyRequest(tenant="revoked", label="t"), timeout=10
        )
        headers = {"X-API-Key": created.api_key}
        url = f"{fleet.base_url}/api/v1/sessions"  # type: ignore[attr-defined]
        assert httpx.get(url, headers=headers).status_code == 200  # now cached
        stub.RevokeApiKey(cpb.RevokeApiKeyRequest(key_id=created.key_id), timeout=10)
    time.sleep(1.0)  # the gateway's auth cache may answer for up to one second
    assert httpx.get(url, headers=headers).status_code == 401


def test_queue_state_of_an_operation_waiting_for_a_slot(fleet: object, client: Client) -> None:
    """A run queued for a trainer slot answers try_again with the queue_state its operation's
    `waiting_for` maps to ("paused_capacity" for a slot), as the controller reports it."""
    caps = client.http.get("/get_server_capabilities").json()["supported_models"]
    base = next(m["model_name"] for m in caps if m["trainable"])
    session = client.post("/create_session", {}).json()["session_id"]
    runs = []
    try:
        for seq in range(5):  # 4 slots, one already taken by `model`: the last run queues
            body = {"session_id": session, "model_seq_id": seq, "base_model": base}
            created = client.post("/create_model", {**body, "lora_config": {"rank": 2}})
            assert created.status_code == 200, created.text
            runs.append(created.json()["model_id"])
        submitted = client.post("/forward", fb_body({"model_id": runs[-1]}, 1))
        assert submitted.status_code == 200, submitted.text
        request_id = submitted.json()["request_id"]
        polled = client.post("/retrieve_future", {"request_id": request_id}).json()
        assert polled["type"] == "try_again", polled
        with fleet.admin_channel() as channel:  # type: ignore[attr-defined]
            stub = controller_pb2_grpc.ControllerServiceStub(channel)
            key = cpb.AuthenticateRequest(api_key=fleet.api_key)  # type: ignore[attr-defined]
            tenant = stub.Authenticate(key, timeout=10).tenant
            lookup = cpb.GetOperationRequest(
                tenant=tenant, operation_id=FutureId.parse(request_id).ref
            )
            op = stub.GetOperation(lookup, timeout=10).operation
        assert op.state == cpb.OPERATION_STATE_QUEUED
        paused = op.waiting_for in (cpb.WAITING_FOR_SLOT, cpb.WAITING_FOR_TRAINER)
        assert polled["queue_state"] == ("paused_capacity" if paused else "active"), op
    finally:
        for run in runs:
            client.post("/unload_model", {"model_id": run})
