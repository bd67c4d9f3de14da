"""Type names for gRPC server code, so servicers and interceptors spell grpc's generics once.

grpc's aio `ServicerContext` and `RpcMethodHandler` are generic over the request and response
messages. A servicer never reads or writes through its context (streams are async
generators), so one context type over protobuf messages serves every method; interceptors
see every method, so they keep the handler's own message types through type variables.
"""

from __future__ import annotations

from typing import TypeAlias, TypeVar

import grpc
from google.protobuf.message import Message

ServerContext: TypeAlias = grpc.aio.ServicerContext[Message, Message]

Request = TypeVar("Request")
Response = TypeVar("Response")
