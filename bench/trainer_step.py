"""Trainer step throughput: the gRPC service vs the same loop in-process with PEFT.

One step = forward_backward (cross_entropy, batch 8 x 128) + optim_step (AdamW), rank-8 LoRA on
attention and MLP of the ~20M "bench" model. The two loops alternate step by step in one run so
machine noise hits both alike. Prints JSON; target ratio (service / PEFT tokens/s) >= 0.95.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BATCH, SEQ, RANK = 8, 128, 8


def bench_model_dir() -> tuple[Path, str]:
    """The ~20M model: lorafleet_models' "bench" preset, else a random 512/6/1536 Llama."""
    try:
        from lorafleet_models.tiny import ensure_model

        return ensure_model("bench", REPO / ".cache" / "models"), "bench"
    except ImportError:
        from transformers import LlamaConfig, LlamaForCausalLM

        folder = REPO / ".cache" / "bench-random-llama"
        if not (folder / "config.json").is_file():
            torch.manual_seed(0)
            LlamaForCausalLM(
                LlamaConfig(
                    vocab_size=2048,
                    hidden_size=512,
                    intermediate_size=1536,
                    num_hidden_layers=6,
                    num_attention_heads=8,
                    num_key_value_heads=8,
                    max_position_embeddings=2048,
                )
            ).save_pretrained(folder)
        return folder, "random-llama-512-6-1536"


def make_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
        torch.randint(0, vocab, (BATCH, SEQ), generator=gen),
    )


class PeftLoop:
    """The in-process reference: PEFT LoRA + torch AdamW, Tinker's summed cross-entropy."""

    def __init__(self, model_dir: Path) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        self.model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=32, target_modules=targets))
        self.opt = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=1e-4,
            betas=(0.9, 0.95),
            eps=1e-12,
            weight_decay=0.0,
        )
        self.vocab = base.config.vocab_size

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> None:
        logits = self.model(input_ids=ids, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1))
        (-logp.sum()).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class ServiceLoop:
    """The same step through `python -m lorafleet_trainer` over gRPC."""

    def __init__(self, model_dir: Path, storage: Path) -> None:
        from lorafleet.testing import child_env, free_port

        self.port = free_port()
        env = child_env(
            LORAFLEET_TRAINER_PORT=str(self.port),
            LORAFLEET_TRAINER_MODEL_PATH=str(model_dir),
            LORAFLEET_TRAINER_NUM_SLOTS="8",
            LORAFLEET_TRAINER_MAX_RANK="64",
            LORAFLEET_TRAINER_STORAGE_ROOT=str(storage),
            LORAFLEET_TRAINER_TORCH_THREADS=str(torch.get_num_threads()),
            LORAFLEET_TRAINER_LOG_LEVEL="WARNING",
        )
        self.proc = subprocess.Popen([sys.executable, "-m", "lorafleet_trainer"], env=env)
        self.n = 0

    async def start(self) -> None:
        from lorafleet.rpc.channel import make_channel
        from lorafleet.testing import wait_for_port
        from lorafleet.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

        await asyncio.to_thread(wait_for_port, self.port, 120.0, self.proc)
        self.channel = make_channel(f"127.0.0.1:{self.port}")
        self.stub = trainer_pb2_grpc.TrainerServiceStub(self.channel)
        cfg = common_pb2.LoraConfig(rank=RANK, alpha=32, train_attn=True, train_mlp=True)
        for _ in range(600):
            try:
                await self.stub.BindSlot(
                    trainer_pb2.BindSlotRequest(slot=0, registration_id="bench", lora_config=cfg),
                    timeout=30,
                )
                return
            except Exception:
                await asyncio.sleep(0.2)
        raise RuntimeError("the trainer never accepted BindSlot")

    async def step(self, ids: torch.Tensor, targets: torch.Tensor) -> None:
        from lorafleet.testing import payload_bytes
        from lorafleet.v1 import common_pb2, trainer_pb2
        from lorafleet_trainer.convert import tensor_to_proto

        self.n += 1
        data = [
            common_pb2.Datum(
                tokens=ids[i].tolist(),
                loss_fn_inputs={
                    "target_tokens": tensor_to_proto(targets[i]),
                    "weights": tensor_to_proto(torch.ones(SEQ)),
                },
            )
            for i in range(BATCH)
        ]
        resp = await self.stub.ForwardBackward(
            trainer_pb2.ForwardBackwardRequest(
                items=[
                    trainer_pb2.ForwardBackwardItem(
                        operation_id=f"fb-{self.n}",
                        slot=0,
                        registration_id="bench",
                        payload=payload_bytes(
                            common_pb2.ForwardBackwardInput(data=data, loss_fn="cross_entropy")
                        ),
                    )
                ]
            ),
            timeout=600,
        )
        assert resp.results[0].WhichOneof("outcome") == "result", resp.results[0].error
        await self.stub.OptimStep(
            trainer_pb2.OptimStepRequest(
                operation_id=f"step-{self.n}",
                slot=0,
                registration_id="bench",
                adam_params=common_pb2.AdamParams(
                    learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12
                ),
            ),
            timeout=120,
        )

    async def stop(self) -> None:
        from lorafleet.testing import stop_process

        await self.channel.close()
        stop_process(self.proc)


async def main(steps: int = 6, warmup: int = 2) -> dict:
    model_dir, model_name = bench_model_dir()
    peft = PeftLoop(model_dir)
    ids, targets = make_batch(peft.vocab)
    with tempfile.TemporaryDirectory() as storage:
        service = ServiceLoop(model_dir, Path(storage))
        try:
            await service.start()
            times: dict[str, list[float]] = {"peft": [], "service": []}
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                peft.step(ids, targets)
                t1 = time.perf_counter()
                await service.step(ids, targets)
                t2 = time.perf_counter()
                if i >= warmup:
                    times["peft"].append(t1 - t0)
                    times["service"].append(t2 - t1)
        finally:
            await service.stop()
    tokens = BATCH * SEQ
    peft_tps = tokens / statistics.median(times["peft"])
    service_tps = tokens / statistics.median(times["service"])
    return {
        "bench": "trainer_step",
        "model": model_name,
        "batch": [BATCH, SEQ],
        "rank": RANK,
        "steps": steps,
        "torch_threads": torch.get_num_threads(),
        "peft_tokens_per_s": round(peft_tps, 1),
        "service_tokens_per_s": round(service_tps, 1),
        "ratio": round(service_tps / peft_tps, 3),
        "target_ratio": 0.95,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
