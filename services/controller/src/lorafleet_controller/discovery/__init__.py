"""Finding trainer and rollout replicas, and electing the one controller that dispatches.

`Discovery` is the interface the controller consumes: `StaticDiscovery` outside a cluster,
`KubernetesDiscovery` (EndpointSlices of the chart's headless Services) inside one.
`LeaderElector` holds a coordination.k8s.io Lease so that several controller replicas can
run while exactly one writes the ledger. The Kubernetes parts are imported on first use, so
a controller that needs neither never loads the `kubernetes` client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lorafleet_controller.discovery.static import StaticDiscovery, parse_static
from lorafleet_controller.discovery.types import ROLLOUT, TRAINER, Discovery, Endpoint

if TYPE_CHECKING:
    from lorafleet_controller.discovery.k8s import KubernetesDiscovery
    from lorafleet_controller.discovery.leader import LeaderElector

__all__ = [
    "ROLLOUT",
    "TRAINER",
    "Discovery",
    "Endpoint",
    "KubernetesDiscovery",
    "LeaderElector",
    "StaticDiscovery",
    "parse_static",
]


def __getattr__(name: str) -> Any:
    if name == "KubernetesDiscovery":
        from lorafleet_controller.discovery.k8s import KubernetesDiscovery

        return KubernetesDiscovery
    if name == "LeaderElector":
        from lorafleet_controller.discovery.leader import LeaderElector

        return LeaderElector
    raise AttributeError(name)
