"""FastAPI dependencies shared by the routers: the tenant, the controller, the settings."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from lorafleet_gateway.auth import tenant_of
from lorafleet_gateway.controller import Controller
from lorafleet_gateway.settings import GatewaySettings


def _controller(request: Request) -> Controller:
    return request.app.state.controller


def _settings(request: Request) -> GatewaySettings:
    return request.app.state.settings


Tenant = Annotated[str, Depends(tenant_of)]
Ctl = Annotated[Controller, Depends(_controller)]
Settings = Annotated[GatewaySettings, Depends(_settings)]
