"""The serving layer: one class per API area, between the thin routers and the controller.

Routers parse HTTP and hand typed request models here; a serving class validates with
`lorafleet.contract`, builds controller messages, calls `ControllerClient` and answers with
the response models of `protocol`. Nothing here imports fastapi, so each area reads as the
flow it implements.
"""

from __future__ import annotations

from dataclasses import dataclass

from lorafleet_gateway.controller import ControllerClient
from lorafleet_gateway.serving.adapters import AdapterServing
from lorafleet_gateway.serving.checkpoints import CheckpointServing
from lorafleet_gateway.serving.common import Ledger
from lorafleet_gateway.serving.futures import FutureServing
from lorafleet_gateway.serving.jobs import JobsServing
from lorafleet_gateway.serving.sampling import SamplingServing
from lorafleet_gateway.serving.service import ServiceServing
from lorafleet_gateway.serving.sessions import SessionServing
from lorafleet_gateway.serving.training import TrainingServing
from lorafleet_gateway.serving.weights import WeightsServing
from lorafleet_gateway.settings import GatewaySettings
from lorafleet_gateway.signing import Signer


@dataclass(frozen=True)
class Serving:
    """Every area's serving object, built once per app around one controller client."""

    controller: ControllerClient
    ledger: Ledger
    service: ServiceServing
    sessions: SessionServing
    training: TrainingServing
    weights: WeightsServing
    sampling: SamplingServing
    futures: FutureServing
    checkpoints: CheckpointServing
    jobs: JobsServing
    adapters: AdapterServing

    @classmethod
    def build(
        cls, controller: ControllerClient, settings: GatewaySettings, signer: Signer
    ) -> Serving:
        ledger = Ledger(controller)
        return cls(
            controller=controller,
            ledger=ledger,
            service=ServiceServing(controller, settings),
            sessions=SessionServing(controller),
            training=TrainingServing(controller, ledger, settings),
            weights=WeightsServing(controller, ledger),
            sampling=SamplingServing(controller),
            futures=FutureServing(controller, settings),
            checkpoints=CheckpointServing(controller, settings, signer),
            jobs=JobsServing(controller.jobs),
            adapters=AdapterServing(controller),
        )
