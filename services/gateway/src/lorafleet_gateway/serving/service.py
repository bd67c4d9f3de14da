"""Bootstrap: client/config, client/dynamic_config and the server's capabilities.

client/config tells the SDK which wire paths to use (tinker-api.md §2). With the recommended
flags 0.24.1 speaks exactly like 0.38 (protobuf forward_backward, forward via
forward_backward, create-from-checkpoint via one load_weights), so one code path serves
both; `proto_flags=false` serves {} so the JSON paths stay tested too.
"""

from __future__ import annotations

from lorafleet import quantize
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.protocol import (
    ClientConfigResponse,
    DynamicConfigResponse,
    ServerCapabilities,
    SupportedModel,
)
from lorafleet_gateway.settings import GatewaySettings


class ServiceServing:
    def __init__(self, controller: ControllerClient, settings: GatewaySettings) -> None:
        self._controller = controller
        self._settings = settings

    def client_config(self) -> ClientConfigResponse:
        if not self._settings.proto_flags:
            return ClientConfigResponse()
        return ClientConfigResponse(
            proto_write_fwdbwd=True,
            fwd_via_fwdbwd=True,
            create_model_via_load_weights=True,
            proto_compress_fwdbwd=self._settings.compress_fwdbwd,
        )

    @staticmethod
    def dynamic_config() -> DynamicConfigResponse:
        return DynamicConfigResponse(
            refresh_interval_sec=300, sample_cancel_enabled=False, sample_cancel_max_batch_size=64
        )

    async def capabilities(self) -> ServerCapabilities:
        return ServerCapabilities(
            supported_models=[
                SupportedModel(
                    model_name=m.name,
                    max_context_length=m.max_context_length or None,
                    trainable=m.trainable,
                    sampleable=m.sampleable,
                    quantization=m.quantization or quantize.NONE,
                )
                for m in await self._controller.capabilities()
            ]
        )
