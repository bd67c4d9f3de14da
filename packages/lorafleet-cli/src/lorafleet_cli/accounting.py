"""`lorafleet adapters import DIR --tenant T`, `lorafleet usage [--tenant T]` and
`lorafleet page-out RUN [--force]`.

All talk to the controller with the run's admin certificate (or LORAFLEET_TLS_* with
--controller). The import sends the folder's two files as they are: the controller checks
them (peft_import.py), so the CLI holds no rule of its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import grpc

from lorafleet.rpc.channel import make_blocking_channel
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.tls import TlsIdentity
from lorafleet.v1 import controller_pb2, controller_pb2_grpc
from lorafleet_cli.fleet import FleetError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
Resolve = Callable[[argparse.Namespace], tuple[str, TlsIdentity | None]]


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser], resolve: Resolve) -> None:
    """Register `adapters import`, `usage` and `page-out`; `resolve` finds the controller and
    identity."""
    adapters = sub.add_parser("adapters", help="adapters: import a PEFT LoRA folder")
    adapters.add_argument("action", choices=("import",))
    adapters.add_argument("dir", help="a PEFT LoRA adapter folder")
    adapters.add_argument("--tenant", required=True)
    adapters.add_argument("--name", default="", help="state name (default: the folder's)")
    adapters.add_argument(
        "--base-model", default="", help="served base model (default: the adapter's)"
    )
    adapters.add_argument("--controller", default="")
    adapters.set_defaults(fn=lambda args: _guard(import_adapter, args, resolve))

    usage = sub.add_parser("usage", help="per-tenant usage totals (chargeback)")
    usage.add_argument("--tenant", default="", help="one tenant (default: every tenant)")
    usage.add_argument("--controller", default="")
    usage.set_defaults(fn=lambda args: _guard(show_usage, args, resolve))

    page = sub.add_parser("page-out", help="page a training run out of its trainer slot now")
    page.add_argument("run", help="training run id (<session>:train:<n>)")
    page.add_argument(
        "--force", action="store_true", help="even with un-stepped gradients (restored by replay)"
    )
    page.add_argument("--controller", default="")
    page.set_defaults(fn=lambda args: _guard(page_out, args, resolve))


def _guard(fn: Callable[..., int], args: argparse.Namespace, resolve: Resolve) -> int:
    try:
        address, tls = resolve(args)
    except FleetError as exc:  # no running fleet: the message says what to do
        print(f"lorafleet: {exc}", file=sys.stderr)
        return 1
    try:
        with make_blocking_channel(address, tls=tls) as ch:
            return fn(args, controller_pb2_grpc.ControllerServiceStub(ch))
    except grpc.RpcError as exc:
        print(f"lorafleet: {from_rpc_error(exc)}", file=sys.stderr)
        return 1


def import_adapter(
    args: argparse.Namespace, stub: controller_pb2_grpc.ControllerServiceStub
) -> int:
    folder = Path(args.dir)
    if not folder.is_dir():
        print(f"lorafleet: {folder} is not a folder", file=sys.stderr)
        return 1
    files = {n: (folder / n).read_bytes() for n in ADAPTER_FILES if (folder / n).is_file()}
    req = controller_pb2.ImportPeftAdapterRequest(
        tenant=args.tenant,
        name=args.name or folder.resolve().name,
        base_model=args.base_model,
        files=files,
    )
    resp = stub.ImportPeftAdapter(req, timeout=600)
    print(resp.path)
    print(
        f"lorafleet: imported onto {resp.base_model} (rank {resp.lora_config.rank}, "
        f"alpha {resp.lora_config.alpha:g}, targets {','.join(resp.lora_config.target_modules)}"
        f") for tenant {args.tenant!r}",
        file=sys.stderr,
    )
    return 0


COLUMNS = (
    "tokens_trained",
    "tokens_forward",
    "tokens_sampled",
    "tokens_prompt",
    "optim_steps",
    "adapter_seconds",
    "stored_bytes",
)


def show_usage(args: argparse.Namespace, stub: controller_pb2_grpc.ControllerServiceStub) -> int:
    resp = stub.GetUsage(controller_pb2.GetUsageRequest(tenant=args.tenant), timeout=10)
    print("\t".join(("tenant", *COLUMNS)))
    for row in resp.tenants:
        values = [
            f"{getattr(row, c):.1f}" if c == "adapter_seconds" else str(getattr(row, c))
            for c in COLUMNS
        ]
        print("\t".join((row.tenant, *values)))
    return 0


def page_out(args: argparse.Namespace, stub: controller_pb2_grpc.ControllerServiceStub) -> int:
    """Page a run out now (paging.py); its next operation pages it back in."""
    req = controller_pb2.PageOutRegistrationRequest(registration_id=args.run, force=args.force)
    resp = stub.PageOutRegistration(req, timeout=300)
    state = controller_pb2.RegistrationState.Name(resp.state).removeprefix("REGISTRATION_STATE_")
    print(f"{args.run}\t{state.lower()}\t{resp.seconds:.3f}s")
    return 0
