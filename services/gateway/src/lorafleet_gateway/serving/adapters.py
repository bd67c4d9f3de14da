"""PEFT adapter import over REST (issue 12 item 6): `POST /v1/lora/adapters/import`.

The body carries the folder's two files base64-encoded; the controller checks them
(lorafleet_controller/peft_import.py) and answers the new state's tinker path, which
`create_training_client_from_state` resumes and `create_sampling_client` serves.
"""

from __future__ import annotations

import base64
import binascii

from lorafleet import errors
from lorafleet.v1 import controller_pb2 as cpb
from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.lora_protocol import ImportedAdapter, ImportedLoraConfig


class AdapterServing:
    def __init__(self, controller: ControllerClient) -> None:
        self._controller = controller

    async def import_peft(
        self, tenant: str, name: str, base_model: str, files: dict[str, str]
    ) -> ImportedAdapter:
        raw = {}
        for filename, data in files.items():
            try:
                raw[filename] = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise errors.InvalidArgument("is not base64", field=f"files.{filename}") from None
        reply = await self._controller.import_peft_adapter(
            cpb.ImportPeftAdapterRequest(tenant=tenant, name=name, base_model=base_model, files=raw)
        )
        lora = reply.lora_config
        return ImportedAdapter(
            path=reply.path,
            training_run_id=reply.training_run_id,
            base_model=reply.base_model,
            lora_config=ImportedLoraConfig(
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                exclude_modules=list(lora.exclude_modules),
            ),
        )
