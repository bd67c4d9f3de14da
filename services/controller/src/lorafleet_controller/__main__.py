"""`python -m lorafleet_controller`: the ControllerService over Redis.

Settings come from LORAFLEET_CONTROLLER_* (see `--help`) and the server's from the same
prefix (host, port, metrics_port, ...). Bad settings or an unreachable Redis print one line
and exit 2, before anything listens.
"""

from __future__ import annotations

import sys

from lorafleet.settings import ServerSettings, load_or_exit
from lorafleet_controller.settings import PREFIX, ControllerSettings


def main() -> None:
    settings = load_or_exit(ControllerSettings, PREFIX)
    server = load_or_exit(ServerSettings, PREFIX)

    import redis

    from lorafleet.rpc.server import ServiceSpec, serve
    from lorafleet.v1 import controller_pb2_grpc
    from lorafleet_controller.controller import Controller
    from lorafleet_controller.servicer import ControllerServicer

    try:
        redis.Redis.from_url(settings.redis_url, socket_connect_timeout=3).ping()
    except (redis.RedisError, ValueError) as exc:
        print(f"error: cannot reach Redis at {settings.redis_url}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None

    holder: dict[str, Controller] = {}

    async def startup() -> None:
        holder["c"] = controller = Controller(settings)
        servicer.c = controller
        await controller.start()

    async def shutdown() -> None:
        if "c" in holder:
            await holder["c"].stop()

    servicer = ControllerServicer.__new__(ControllerServicer)
    spec = ServiceSpec(
        servicer=servicer,
        add_fn=controller_pb2_grpc.add_ControllerServiceServicer_to_server,
        full_name="lorafleet.v1.ControllerService",
    )
    serve("controller", server, [spec], startup=startup, shutdown=shutdown)


if __name__ == "__main__":
    main()
