"""`lorafleet keys create|list|revoke`: API keys live (hashed) in the controller's Redis.

These are admin RPCs: the calls present the run's admin certificate (or the one in
LORAFLEET_TLS_* with --controller).
"""

from __future__ import annotations

import argparse
import sys
import time

import grpc

from lorafleet.rpc.channel import make_blocking_channel
from lorafleet.rpc.errors import from_rpc_error
from lorafleet.tls import TlsIdentity
from lorafleet.v1 import controller_pb2, controller_pb2_grpc


def run(args: argparse.Namespace, controller: str, tls: TlsIdentity | None) -> int:
    if args.action == "list" and not args.target:
        print("lorafleet: keys list needs a tenant: `lorafleet keys list TENANT`", file=sys.stderr)
        return 1
    if args.action == "revoke" and not args.target:
        print("lorafleet: keys revoke needs a key id", file=sys.stderr)
        return 1
    with make_blocking_channel(controller, tls=tls) as ch:
        stub = controller_pb2_grpc.ControllerServiceStub(ch)
        try:
            if args.action == "create":
                tenant = args.target or "local"
                created = stub.CreateApiKey(
                    controller_pb2.CreateApiKeyRequest(tenant=tenant, label=args.label),
                    timeout=10,
                )
                print(created.api_key)
                print(
                    f"lorafleet: key {created.key_id} for tenant {tenant!r} (shown once)",
                    file=sys.stderr,
                )
            elif args.action == "list":
                listed = stub.ListApiKeys(
                    controller_pb2.ListApiKeysRequest(tenant=args.target), timeout=10
                )
                for k in listed.keys:
                    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(k.created_at))
                    state = "revoked" if k.revoked else "active"
                    print(f"{k.key_id}  {k.tenant:<16} {state:<8} {when}  {k.label}")
            else:
                stub.RevokeApiKey(
                    controller_pb2.RevokeApiKeyRequest(key_id=args.target), timeout=10
                )
                print(f"lorafleet: revoked {args.target}", file=sys.stderr)
        except grpc.RpcError as exc:
            print(f"lorafleet: {from_rpc_error(exc)}", file=sys.stderr)
            return 1
    return 0
