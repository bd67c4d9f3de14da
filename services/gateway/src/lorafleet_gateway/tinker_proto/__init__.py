"""Tinker's public protobuf schema (package tinker_public), generated from
proto/tinker_public/tinker_public.proto; the gateway never imports the tinker SDK.

Regenerate (from the repository root) with:

    .venv/bin/python -m grpc_tools.protoc -I proto/tinker_public \
        --python_out=services/gateway/src/lorafleet_gateway/tinker_proto \
        --pyi_out=services/gateway/src/lorafleet_gateway/tinker_proto \
        proto/tinker_public/tinker_public.proto

Byte compatibility with both SDKs is tested in services/gateway/tests/test_tinker_proto_compat.py.
"""
