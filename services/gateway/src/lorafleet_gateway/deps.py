"""FastAPI dependencies shared by the routers: the tenant and the serving layer."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from lorafleet_gateway.auth import tenant_of
from lorafleet_gateway.serving import Serving


def _serving(request: Request) -> Serving:
    serving: Serving = request.app.state.serving
    return serving


Tenant = Annotated[str, Depends(tenant_of)]
Areas = Annotated[Serving, Depends(_serving)]
