"""PEFT import (issue 12 item 6) and per-tenant usage accounting (item 7), end to end.

A LoRA trained in-process with PEFT on the tiny model is imported with `lorafleet adapters
import`, resumed with the real SDK, and must give PEFT's logprobs; bad folders are refused
naming the field, with nothing written. Two tenants then train and sample through the SDK,
and `lorafleet usage` and the controller's Prometheus counters must move by exactly what
each sent.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import torch

from lorafleet.rpc.errors import from_rpc_error
from lorafleet.testing import wait_until
from lorafleet.v1 import controller_pb2, controller_pb2_grpc
from lorafleet_cli.ca import ADMIN_NAME

from .conftest import Target

pytestmark = pytest.mark.slow
LORAFLEET = [sys.executable, "-m", "lorafleet_cli.main"]
TOKENS = [5, 17, 23, 9, 41, 12, 33, 8, 19, 27, 6, 14]


def _cli(fleet: object, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **fleet.certs[ADMIN_NAME].env()}  # type: ignore[attr-defined]
    return subprocess.run(
        [*LORAFLEET, *args, "--controller", fleet.controller_address],  # type: ignore[attr-defined]
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _peft_adapter(model_dir: Path, out: Path) -> tuple[Path, list[float]]:
    """A rank-4 LoRA trained for a few steps with PEFT (B != 0); its logprobs of TOKENS."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    peft = get_peft_model(model, cfg)
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.tensor([TOKENS])
    for _ in range(5):
        loss = peft(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    peft.eval()
    with torch.no_grad():
        logits = peft(input_ids=ids[:, :-1]).logits[0]
    logprobs = torch.log_softmax(logits.double(), -1).gather(1, ids[0, 1:, None])[:, 0]
    peft.save_pretrained(out)
    assert any(v.abs().max() > 0 for k, v in peft.state_dict().items() if "lora_B" in k), (
        "the PEFT adapter must have trained (B != 0)"
    )
    return out, logprobs.tolist()


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    return _peft_adapter(tiny_model_dir, tmp_path_factory.mktemp("peft") / "my-adapter")


def test_peft_import_resumes_with_peft_logprobs(
    fleet: object, target: Target, run_sdk: Callable[..., dict], adapter
) -> None:
    folder, expected = adapter
    made = _cli(fleet, "adapters", "import", str(folder), "--tenant", "local")
    assert made.returncode == 0, made.stderr
    path = made.stdout.strip()
    assert re.fullmatch(r"tinker://[^/]+/weights/my-adapter", path), path
    got = run_sdk(
        "0.38.0",
        "import_usage_script.py",
        target,
        MODE="resume",
        IMPORT_PATH=path,
        TOKENS=json.dumps(TOKENS),
    )
    assert len(got["logprobs"]) == len(expected)
    assert max(abs(a - b) for a, b in zip(got["logprobs"], expected, strict=True)) <= 1e-5
    # The same import through the gateway's own REST route, as the caller's tenant.
    files = {p.name: base64.b64encode(p.read_bytes()).decode() for p in folder.iterdir()}
    resp = _rest_import(target, "rest", files)
    assert resp.status_code == 200, resp.text
    assert re.fullmatch(r"tinker://[^/]+/weights/rest", resp.json()["path"]), resp.text
    assert resp.json()["lora_config"]["target_modules"] == ["q_proj", "v_proj"]
    cfg = json.loads((folder / "adapter_config.json").read_text()) | {"use_dora": True}
    files["adapter_config.json"] = base64.b64encode(json.dumps(cfg).encode()).decode()
    resp = _rest_import(target, "dora", files)
    assert resp.status_code == 400 and "use_dora" in resp.text, resp.text
    # The sampler serves the imported adapter: its greedy tokens' logprobs are PEFT's.
    assert got["sample_tokens"], got
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(target.model_dir, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    seq = TOKENS + got["sample_tokens"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq[:-1]])).logits[0].double()
    ref = torch.log_softmax(logits, -1)[len(TOKENS) - 1 :].gather(
        1, torch.tensor(got["sample_tokens"])[:, None]
    )[:, 0]
    assert got["sample_tokens"][0] == int(logits[len(TOKENS) - 1].argmax())
    assert (
        max(abs(a - b) for a, b in zip(got["sample_logprobs"], ref.tolist(), strict=True)) <= 1e-4
    )


def _rest_import(target: Target, name: str, files: dict[str, str]) -> httpx.Response:
    return httpx.post(
        f"{target.base_url}/v1/lora/adapters/import",
        json={"name": name, "files": files},
        headers={"X-API-Key": target.api_key},
        timeout=300,
    )


def _rewrite(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    (dst / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    return dst


def _big_rank(src: Path, dst: Path, rank: int) -> Path:
    from safetensors.torch import load_file, save_file

    out = _rewrite(src, dst, r=rank)
    tensors = load_file(src / "adapter_model.safetensors")
    big = {
        k: (torch.zeros(rank, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], rank))
        for k, v in tensors.items()
    }
    save_file(big, out / "adapter_model.safetensors")
    return out


def test_bad_adapters_are_refused_naming_the_field(fleet: object, adapter, tmp_path: Path) -> None:
    folder, _ = adapter
    cfg = "files.adapter_config.json."
    cases = {
        "base": (
            _rewrite(folder, tmp_path / "base", base_model_name_or_path="org/other-model"),
            cfg + "base_model_name_or_path",
        ),
        "rank": (_big_rank(folder, tmp_path / "rank", 2048), cfg + "r"),
        "targets": (
            _rewrite(folder, tmp_path / "targets", target_modules=["q_proj", "zz_proj"]),
            cfg + "target_modules",
        ),
        "dora": (_rewrite(folder, tmp_path / "dora", use_dora=True), cfg + "use_dora"),
        "rslora": (_rewrite(folder, tmp_path / "rslora", use_rslora=True), cfg + "use_rslora"),
    }
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "adapter_config.json").write_bytes((folder / "adapter_config.json").read_bytes())
    cases["missing"] = (missing, "files.adapter_model.safetensors")
    r = redis.Redis.from_url(fleet.redis_url)  # type: ignore[attr-defined]
    before = sorted(r.keys("*bad-tenant*"))
    with fleet.admin_channel() as ch:  # type: ignore[attr-defined]
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        for case, (path, field) in cases.items():
            files = {p.name: p.read_bytes() for p in path.iterdir()}
            req = controller_pb2.ImportPeftAdapterRequest(
                tenant="bad-tenant", name=case, files=files
            )
            with pytest.raises(grpc.RpcError) as info:
                stub.ImportPeftAdapter(req, timeout=60)
            err = from_rpc_error(info.value)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err)
            assert err.field == field, (case, err.field, err.message)
            if case == "targets":  # the field is the list; the message names the bad entry
                assert "'zz_proj'" in err.message, err.message
    assert sorted(r.keys("*bad-tenant*")) == before == []
    # The CLI shows the same error in one line.
    out = _cli(fleet, "adapters", "import", str(cases["dora"][0]), "--tenant", "bad-tenant")
    assert out.returncode == 1
    assert "use_dora" in out.stderr and "DoRA" in out.stderr


def _usage(fleet: object, tenant: str) -> dict[str, float]:
    out = _cli(fleet, "usage", "--tenant", tenant)
    assert out.returncode == 0, out.stderr
    head, row = out.stdout.strip().splitlines()
    return {k: float(v) for k, v in zip(head.split("\t")[1:], row.split("\t")[1:], strict=True)}


def _scrape(fleet: object) -> str:
    ports = [m.metrics_port for m in fleet.members if m.service == "controller"]  # type: ignore[attr-defined]
    return httpx.get(f"http://127.0.0.1:{ports[0]}/metrics", timeout=10).text


def _metric(text: str, name: str, tenant: str) -> float | None:
    m = re.search(rf'^{name}{{tenant="{tenant}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def test_usage_counts_exactly_what_each_tenant_sent(
    fleet: object, target: Target, run_sdk: Callable[..., dict]
) -> None:
    plans = {"usage-a": ([5, 7], 2, 6), "usage-b": ([9], 1, 3)}
    sent = {}
    start = time.monotonic()
    for tenant, (lengths, steps, max_tokens) in plans.items():
        key = fleet.create_api_key(tenant, "usage test")  # type: ignore[attr-defined]
        who = Target(target.base_url, key, target.base_model, target.model_dir)
        assert _usage(fleet, tenant)["tokens_trained"] == 0
        sent[tenant] = run_sdk(
            "0.38.0",
            "import_usage_script.py",
            who,
            MODE="work",
            LENGTHS=json.dumps(lengths),
            STEPS=str(steps),
            SAMPLE_MAX=str(max_tokens),
        )
    elapsed = time.monotonic() - start
    for tenant, want in sent.items():
        got = _usage(fleet, tenant)
        for k in (
            "tokens_trained",
            "tokens_forward",
            "optim_steps",
            "tokens_prompt",
            "tokens_sampled",
        ):
            assert got[k] == want[k], (tenant, k, got, want)
        assert got["stored_bytes"] > 0
        # Slot residency: one run held one slot for part of the test, never more than all of it.
        got = wait_until(
            lambda t=tenant: (u := _usage(fleet, t))["adapter_seconds"] > 0 and u,
            "adapter_seconds moved",
        )
        assert got["adapter_seconds"] <= time.monotonic() - start + elapsed
    # The controller exports the same totals as Prometheus counters labelled by tenant.

    def exported() -> str:
        text = _scrape(fleet)
        ok = all(
            _metric(text, f"lorafleet_tenant_{k}_total", t) == sent[t][k]
            for t in sent
            for k in ("tokens_trained", "tokens_sampled", "optim_steps")
        )
        return text if ok else ""

    text = wait_until(exported, "the tenant counters exported")
    assert (_metric(text, "lorafleet_tenant_stored_bytes", "usage-a") or 0) > 0
