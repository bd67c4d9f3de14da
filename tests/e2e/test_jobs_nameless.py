"""Managed jobs on a model whose served name resolves nowhere (issue 23), through a real fleet.

The trainer and rollout serve the tiny model as `nowhere/unknown-model` (BASE_MODEL_NAME),
each with its own Hugging Face cache; the controller has an empty one and no model folder.
Offline, nothing in the controller can load a tokenizer by that name: a job that succeeds
formatted its data with the tokenizer the trainer streamed (`ExportTokenizer`).

The long document: 5,000 tokens in 32-token windows on the 512-position model trains end to
end, and the trainer's own count of the tokens its forward computed
(`lorafleet_trainer_forward_tokens_total`) stays within 1.1 × the document's tokens per pass
over it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

NAME = "nowhere/unknown-model"
NO_EARLY_STOP = {"loss_target": "0", "early_stop": "0"}


@pytest.fixture(scope="module")
def fleet(make_fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    homes = {s: tmp_path_factory.mktemp(f"hf-{s}") for s in ("controller", "trainer", "rollout")}
    env = {s: {"HF_HOME": str(home)} for s, home in homes.items()}
    for service in ("trainer", "rollout"):
        env[service][f"LORAFLEET_{service.upper()}_BASE_MODEL_NAME"] = NAME
    with make_fleet(slots=2, extra_env=env) as fleet:
        fleet.controller_hf_home = homes["controller"]
        yield fleet
    # The controller resolved nothing by name: its cache stayed empty.
    assert not any(homes["controller"].rglob("*")), list(homes["controller"].rglob("*"))


def api(fleet: Any) -> httpx.Client:
    key = fleet.create_api_key(f"nameless-{uuid.uuid4().hex[:8]}", "test_jobs_nameless")
    return httpx.Client(base_url=fleet.base_url, headers={"X-API-Key": key}, timeout=900)


def forward_tokens(fleet: Any) -> dict[str, float]:
    """The trainer's forward token counters by kind (datum, context)."""
    (trainer,) = [m for m in fleet.members if m.service == "trainer"]
    text = httpx.get(f"http://127.0.0.1:{trainer.metrics_port}/metrics", timeout=30).text
    found = re.findall(
        r'^lorafleet_trainer_forward_tokens_total\{kind="(\w+)"\} (\S+)$', text, re.MULTILINE
    )
    return {kind: float(value) for kind, value in found}


def test_a_qa_job_uses_the_chat_template_the_trainer_serves(fleet) -> None:
    with api(fleet) as c:
        job = c.post(
            "/v1/lora/train-qa",
            json={"pairs": [{"Q": "What is my name?", "A": "Dima"}], "params": {"max_iters": "1"}},
        ).json()
        c.post("/v1/lora/reset")
    assert job["state"] == "succeeded", job
    assert job["chatTemplate"] == "chatml" and job["unitCount"] == 4, job


def test_a_document_longer_than_the_context_trains_at_linear_cost(fleet, tiny_model_dir) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    lines = [
        f"Entry {i}: the keeper of light {i % 7} logs ship {i * 13 % 101} at dusk."
        for i in range(2000)
    ]
    ids = tok.encode(" ".join(lines), add_special_tokens=False)
    assert len(ids) >= 5000
    text = tok.decode(ids[:5000])
    n = len(tok.encode(text, add_special_tokens=False))
    assert n > 5000 - 10  # decoding and encoding again may merge a token or two
    before = forward_tokens(fleet)
    params = {
        "chunk_tokens": "32",
        "max_iters": "1",
        "gradient_accumulation": "8",
        "learning_rate": "0.001",
        **NO_EARLY_STOP,
    }
    with api(fleet) as c:
        # A window longer than the model's positions is refused before anything is made.
        r = c.post("/v1/lora/train", params={**params, "chunk_tokens": "513"}, json={"text": text})
        assert r.status_code == 400 and "chunk_tokens" in r.text and "512 positions" in r.text
        job = c.post("/v1/lora/train", params=params, json={"text": text}).json()
        c.post("/v1/lora/reset")
    assert job["state"] == "succeeded", job
    windows = -(-(n - 1) // 32)
    assert job["chunkCount"] == windows and job["passCount"] == 1, job
    assert job["optimizerUpdateCount"] == -(-windows // 8)
    after = forward_tokens(fleet)
    datum = after["datum"] - before.get("datum", 0.0)
    context = after["context"] - before.get("context", 0.0)
    # Two passes over the document: the initial loss (forward only), then the training pass;
    # in each, every window's own tokens once.
    assert datum == 2 * (n - 1)
    ratio = (datum + context) / (2 * n)
    print(
        f"forward tokens per document token: {ratio:.4f} ({datum:.0f} + {context:.0f} "
        f"context for 2 passes over {n} tokens)"
    )
    assert ratio <= 1.1
