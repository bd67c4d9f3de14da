"""Trainer groups: one replica = N ranks under torch.distributed, the frozen base sharded.

Launched by `torchrun --nproc-per-node N` (or any launcher that sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT); gloo on CPU, NCCL on GPU. Each rank loads the
model, wraps its LoRA sites exactly as a single process does, then shards the base with
FSDP2 `fully_shard`, one unit per decoder layer plus the root: at rest a rank holds 1/N of
every base matrix, and a layer's matrices are all-gathered only while it runs (its forward,
and again for its backward unless `group_reshard_after_forward` keeps them gathered between
the two, as it does on the CPU). We chose FSDP2 over DTensor tensor parallelism because it is
model-agnostic: it shards whatever a layer holds (fused projections, 3-D expert banks) with
no per-architecture plan, leaves every module's math (and so our LoRA wrappers and their
exactness) untouched, and the base is frozen, so there are no base gradients to
reduce-scatter. Tensor parallelism would split the compute as well, but needs a sharding
plan per architecture and changes the reduction order of every projection.

Every rank runs the same engine calls on the same inputs: validation, slot state, per-slot
AdamW, the float64 clip with its non-finite veto and hashed dropout are the single process's
code, on every rank. Rank 0 serves the gRPC contract through `GroupEngine`: each call that
runs the model or changes slot state is first broadcast to the other ranks (`worker_loop`)
on a gloo control group, then run locally; after it every rank shares its outcome
(`Group.agree`, which is also the barrier). A rank that died or hangs makes a collective
fail (peer connection closed, or the group timeout), and a rank whose outcome differs has
diverged; either way the survivor exits the process (`on_lost`): the replica goes down as a
whole, its heartbeat stops, and the controller's replica-loss policy applies. Idle workers
are kept from timing out by pings.

A forward_backward is data parallel (`GroupShare`): the engine sorts the batch's rows by
slot as one process does, and each rank computes a contiguous share of them balanced by
token count (`rowshare.balance`, slots kept whole where that balances). A datum is never
split, so a loss over one sequence (gspo's sequence ratio) sees all of it, and token-mean
normalisation uses the caller's whole-batch `group_tokens`, the same on every rank. The
LoRA weights are replicated, not sharded (they are created after `fully_shard`, outside the
base's parameters), so the gradients are summed with one all-reduce of every trained slot's
flattened LoRA gradients: FSDP's reduce-scatter would need the adapters inside its units,
and would shard moments that per-slot AdamW, the clip's global norm and the state files
want whole on every rank (they are small: rank x width per module). After the all-reduce
every rank holds the whole batch's gradients, so each one's clip norm is the global norm and
the optimizer steps agree. Per-datum results are gathered on the control group, so every
rank returns them in the caller's order. Truncated-BPTT windows carry keys/values from one
window to the next; every rank runs them all (only rank 0's count in the gradient sum).
Every rank runs each forward and backward, even with no rows of its own (a one-token row
through no slot), so FSDP's all-gathers stay in step.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lorafleet.errors import LorafleetError
from lorafleet_trainer.rowshare import balance

log = logging.getLogger(__name__)

EXIT_LOST = 3  # exit status of a rank whose group broke

# Engine methods every rank runs, in rank 0's order: they run the model or change slot state.
# (import_adapter too, with its files: GroupEngine.import_adapter.)
BROADCAST = ("bind", "unbind", "forward_backward", "optim_step", "load_state")


@dataclass(frozen=True)
class GroupEnv:
    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> GroupEnv | None:
        """The launcher's variables; None when not launched as a group (no WORLD_SIZE)."""
        if "WORLD_SIZE" not in os.environ:
            return None
        return cls(
            int(os.environ.get("RANK", "0")),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", "0")),
        )


def launcher_env(
    rank: int, world_size: int, master_port: int, master_addr: str = "127.0.0.1"
) -> dict[str, str]:
    """The variables torchrun sets for `rank` of a one-node group (what from_environ reads)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


class GroupLost(RuntimeError):
    """A collective failed: another rank died, hung past the timeout, or left."""


class Group:
    """The process group of a replica and its gloo control group."""

    def __init__(self, env: GroupEnv, device: torch.device, timeout: float) -> None:
        self.env = env
        self.device = device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(seconds=timeout)
        )
        self.control = (
            dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
            if backend != "gloo"
            else dist.group.WORLD
        )

    @property
    def rank(self) -> int:
        return self.env.rank

    def send(self, message: Any) -> Any:
        """Broadcast `message` from rank 0 (others pass None and get it); GroupLost on failure."""
        box = [message]
        try:
            dist.broadcast_object_list(box, src=0, group=self.control)
        except Exception as exc:  # gloo raises RuntimeError subclasses for a dead peer
            raise GroupLost(f"control broadcast failed: {exc}") from exc
        return box[0]

    def agree(self, outcome: Any) -> None:
        """Every rank's outcome of the call just run; GroupLost unless all are rank 0's.

        This is also the barrier after each call: a rank that died or diverged (an error
        only it saw, so its slots no longer match) takes the replica down, never silently.
        """
        outcomes: list[Any] = [None] * self.env.world_size
        try:
            dist.all_gather_object(outcomes, outcome, group=self.control)
        except Exception as exc:
            raise GroupLost(f"barrier failed: {exc}") from exc
        if any(o != outcomes[0] for o in outcomes):
            raise GroupLost(f"ranks disagree on the outcome of a call: {outcomes}")

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class GroupShare:
    """A rank's share of each batch and the collectives that combine the shares."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.rank = group.env.rank
        self.world = group.env.world_size

    def share(self, lengths: list[int], slots: Sequence[Hashable]) -> tuple[int, int]:
        return balance(lengths, slots, self.world)[self.rank]

    def sum_gradients(self, flat: torch.Tensor) -> None:
        dist.all_reduce(flat)

    def gather(self, local: Any) -> list[Any]:
        shares: list[Any] = [None] * self.world
        dist.all_gather_object(shares, local, group=self.group.control)
        return shares


def inputs_need_grad(model: nn.Module) -> None:
    """Embeddings that require grad whenever grad is on, so every decoder layer's output does.

    FSDP2 all-gathers a layer again in backward only where its output requires grad; without
    this, a rank whose rows reach no LoRA weight in a layer (no rows, or slots that target
    other modules) would skip an all-gather the others wait on.
    """

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and not out.requires_grad:
            return out.detach().requires_grad_()
        return out

    embeddings: nn.Module = cast(Any, model).get_input_embeddings()
    embeddings.register_forward_hook(hook)


def outcome_of(result: Any) -> Any:
    """What must be equal on every rank after a call: which items failed, and how."""

    def one(r: Any) -> Any:
        if isinstance(r, LorafleetError):
            return (type(r).__name__, r.field)
        if isinstance(r, BaseException):
            return (type(r).__name__, str(r))
        return "ok"

    return [one(r) for r in result] if isinstance(result, list) else one(result)


def run_call(engine: Any, name: str, args: tuple[object, ...]) -> tuple[Any, BaseException | None]:
    """Run one engine call: (result, None) or (None, the exception it raised)."""
    try:
        return getattr(engine, name)(*args), None
    except Exception as exc:
        return None, exc


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformers' `_no_split_modules`), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class to shard by")
    return layers


def reshard_after_forward(choice: str, device: torch.device) -> bool:
    """The `group_reshard_after_forward` setting resolved for a device (see its doc).

    Measured on the CPU bench (`bench/trainer_group.py`, ~20M model, 8x128, 2 ranks of one
    thread): step time world 2 / world 1 is 1.25 when each layer is gathered again for its
    backward and 1.07 when it is kept; each rank's peak memory above the runtime rose from
    0.627 to 0.635 of one process's, and the base held at rest stays at 1/N.
    """
    if choice == "auto":
        return device.type == "cuda"
    return choice == "true"


def shard_base(model: nn.Module, group: Group, reshard: bool = True) -> None:
    """FSDP2: one unit per decoder layer, then the root (embeddings, final norm, head).

    `reshard` frees each layer's gathered weights after its forward; False keeps them until
    its backward has run (the root is never resharded between the two: FSDP2's rule).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(group.device.type, (group.env.world_size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh)


def local_fraction(model: nn.Module) -> float:
    """Share of the base's parameter elements this rank holds at rest (1.0 unsharded)."""
    local = total = 0
    for p in model.parameters():
        total += p.numel()
        local += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    return local / total


class GroupEngine:
    """Rank 0's engine: broadcasts what every rank must run, then runs it locally.

    Everything else (info, list_slots, export_adapter, attributes) is rank 0's own. A lost
    group calls `on_lost` (the service exits the process) and raises GroupLost.
    """

    def __init__(self, engine: Any, group: Group, keepalive: float, on_lost: Any) -> None:
        self.engine = engine
        self.group = group
        self.on_lost = on_lost
        self._lock = threading.Lock()
        self._closed = False
        self._last = time.monotonic()
        self._keepalive = keepalive
        self._pinger = threading.Thread(target=self._ping_loop, name="group-ping", daemon=True)
        self._pinger.start()

    def __getattr__(self, name: str) -> Any:
        if name in BROADCAST:
            return lambda *args: self._everywhere(name, args)
        return getattr(self.engine, name)

    def _lost(self, exc: GroupLost) -> None:
        self._closed = True
        log.error("trainer group lost (rank %d): %s", self.group.rank, exc)
        self.on_lost(exc)

    def _everywhere(
        self, name: str, args: tuple[object, ...], sent: tuple[object, ...] | None = None
    ) -> Any:
        """Send (name, sent or args) to the others, run (name, args) here, agree on it."""
        with self._lock:
            try:
                self.group.send((name, args if sent is None else sent))
                self._last = time.monotonic()
                result, error = run_call(self.engine, name, args)
                self.group.agree(outcome_of(error or result))
            except GroupLost as exc:
                self._lost(exc)
                raise
            if error is not None:
                raise error
            return result

    def import_adapter(
        self, operation_id: str, slot: int, registration_id: str, folder: Path
    ) -> Any:
        """The adapter's files travel with the call: the other ranks may be on other nodes."""
        files = {p.name: p.read_bytes() for p in Path(folder).iterdir() if p.is_file()}
        return self._everywhere(
            "import_adapter",
            (operation_id, slot, registration_id, folder),
            (operation_id, slot, registration_id, files),
        )

    def save_state(self, operation_id: str, slot: int, registration_id: str, *rest: Any) -> Any:
        """Rank 0 writes; the others record the operation id and result, as it did."""
        with self._lock:
            ref = self.engine.save_state(operation_id, slot, registration_id, *rest)
            try:
                self.group.send(("record", (slot, registration_id, operation_id, ref)))
                self.group.agree("ok")
            except GroupLost as exc:
                self._lost(exc)
                raise
            self._last = time.monotonic()
            return ref

    def _ping_loop(self) -> None:
        while not self._closed:
            time.sleep(self._keepalive / 2)
            with self._lock:
                if self._closed or time.monotonic() - self._last < self._keepalive / 2:
                    continue
                try:
                    self.group.send(("ping", ()))
                    self._last = time.monotonic()
                except GroupLost as exc:
                    self._lost(exc)
                    return

    def close(self) -> None:
        """Release the workers (they return from worker_loop); safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self.group.send(("stop", ()))
            except GroupLost as exc:
                log.warning("trainer group: stop not delivered: %s", exc)


def worker_loop(engine: Any, group: Group) -> None:
    """Ranks > 0: run rank 0's calls until it says stop; GroupLost when the group breaks.

    Domain errors are rank 0's to report (validation is deterministic: this rank raised the
    same one and changed nothing); `agree` checks that it did.
    """
    while True:
        name, args = group.send(None)
        if name == "stop":
            return
        if name == "ping":
            continue
        if name == "record":
            slot, registration_id, operation_id, ref = args
            engine.slots.leased(slot, registration_id).ops.record(operation_id, ref)
            group.agree("ok")
        elif name == "import_adapter":
            *call, files = args
            with tempfile.TemporaryDirectory() as tmp:
                for file, data in files.items():
                    (Path(tmp) / file).write_bytes(data)
                result, error = run_call(engine, name, (*call, Path(tmp)))
            group.agree(outcome_of(error or result))
        else:
            result, error = run_call(engine, name, args)
            group.agree(outcome_of(error or result))


def load_group_engine(
    path: Any,
    env: GroupEnv,
    *,
    device: str,
    dtype: str,
    timeout: float,
    base_model: str,
    reshard: str = "auto",
    **engine_kwargs: Any,
) -> tuple[Any, Group]:
    """Join the group, load the model on the CPU, wrap its sites, then shard the base.

    transformers maps the safetensors files rather than reading them (measured: the RSS of
    a loaded ~20M model grows by a sixth of its size), and fully_shard copies only this
    rank's rows, so a rank's own memory is its shard while the file pages are shared page
    cache. Checkpoints that loading converts (per-expert MoE files fused into 3-D banks, a
    dtype change) are materialised whole on every rank first: a meta-device init with
    per-rank reads is what those need at scale.
    """
    from transformers import AutoModelForCausalLM

    from lorafleet_trainer.engine import TrainerEngine

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    dev = torch.device(f"cuda:{env.local_rank}" if device == "cuda" else "cpu")
    group = Group(env, dev, timeout)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    engine = TrainerEngine(model, base_model=base_model, **engine_kwargs)
    inputs_need_grad(engine.model)
    shard_base(engine.model, group, reshard_after_forward(reshard, dev))
    engine.device = dev
    engine.share = GroupShare(group)
    return engine, group


def exit_lost(exc: BaseException) -> None:
    """`on_lost` of a service: without all its ranks the replica cannot run; exit now.

    The process exits from whichever thread saw the failure, so an in-flight RPC ends with
    UNAVAILABLE, the heartbeat stops and the controller's replica-loss policy takes over.
    """
    logging.shutdown()
    os._exit(EXIT_LOST)


def serve_worker(engine: Any, group: Group) -> None:
    """A rank > 0 of a service: follow rank 0 until it stops (exit 0) or is lost (exit 3).

    Stop signals are ignored: torchrun and Kubernetes signal every rank at once, and rank 0
    drains its in-flight operations (which need this rank) before it releases the others.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        worker_loop(engine, group)
    except GroupLost as exc:
        log.error("trainer group lost (rank %d): %s", group.rank, exc)
        exit_lost(exc)
    group.close()
    logging.shutdown()
    os._exit(0)
