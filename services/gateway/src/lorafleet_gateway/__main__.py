"""`python -m lorafleet_gateway`: settings from LORAFLEET_GATEWAY_* (see --help), then uvicorn.

Bad settings print one line naming the variable and exit 2.
"""

from __future__ import annotations

import sys

import uvicorn
from prometheus_client import start_http_server

from lorafleet.logging import setup_logging
from lorafleet.settings import SettingsError, load_or_exit
from lorafleet_gateway.app import build_app
from lorafleet_gateway.settings import ENV_PREFIX, GatewaySettings
from lorafleet_gateway.signing import load_secret


def main() -> None:
    settings = load_or_exit(GatewaySettings, ENV_PREFIX)
    try:
        secret = load_secret(settings.download_secret, settings.download_secret_file, ENV_PREFIX)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    setup_logging("gateway", settings.log_level)
    if settings.metrics_port:
        start_http_server(settings.metrics_port, addr=settings.host)
    uvicorn.run(
        build_app(settings, secret),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        log_config=None,  # keep the JSON handler setup_logging installed
        timeout_graceful_shutdown=10,
    )


if __name__ == "__main__":
    main()
