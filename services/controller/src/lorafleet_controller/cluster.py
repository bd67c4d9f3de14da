"""Build discovery and the leader elector from ControllerSettings.

Kept apart from `__main__` so the choices (and their one-line errors) are testable, and so a
controller in 'self' mode without leader election never imports the `kubernetes` client.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from lorafleet.errors import InvalidArgument
from lorafleet_controller.discovery.static import StaticDiscovery, parse_static
from lorafleet_controller.discovery.types import ROLLOUT, TRAINER, Discovery
from lorafleet_controller.settings import ControllerSettings

if TYPE_CHECKING:
    from lorafleet_controller.discovery.leader import LeaderElector


def kube_api_client() -> Any:
    """In a pod, the service account; elsewhere `$KUBECONFIG` (tests, `kubectl` users)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def build_discovery(settings: ControllerSettings) -> Discovery | None:
    """None in 'self' mode (replicas call RegisterReplica; heartbeats tell losses)."""
    if settings.discovery == "static":
        endpoints = [
            *parse_static(TRAINER, settings.trainers, field="trainers"),
            *parse_static(ROLLOUT, settings.rollouts, field="rollouts"),
        ]
        if not endpoints:
            raise InvalidArgument("discovery=static needs TRAINERS or ROLLOUTS", field="trainers")
        return StaticDiscovery(endpoints)
    if settings.discovery == "kubernetes":
        services = {
            name: kind
            for name, kind in (
                (settings.trainer_service, TRAINER),
                (settings.rollout_service, ROLLOUT),
            )
            if name
        }
        if not services:
            raise InvalidArgument(
                "discovery=kubernetes needs TRAINER_SERVICE or ROLLOUT_SERVICE",
                field="trainer_service",
            )
        from lorafleet_controller.discovery.k8s import KubernetesDiscovery

        return KubernetesDiscovery(kube_api_client(), settings.namespace, services)
    return None


def check_lease_timings(settings: ControllerSettings) -> None:
    s = settings
    if not s.lease_retry_period_seconds < s.lease_renew_deadline_seconds < s.lease_duration_seconds:
        raise InvalidArgument(
            "need LEASE_RETRY_PERIOD_SECONDS < LEASE_RENEW_DEADLINE_SECONDS < "
            f"LEASE_DURATION_SECONDS, got {s.lease_retry_period_seconds:g} / "
            f"{s.lease_renew_deadline_seconds:g} / {s.lease_duration_seconds:g}",
            field="lease_renew_deadline_seconds",
        )


def build_elector(
    settings: ControllerSettings,
    on_started: Callable[[], Awaitable[None]],
    on_stopped: Callable[[], Awaitable[None]],
) -> LeaderElector:
    from lorafleet_controller.discovery.leader import LeaderElector

    check_lease_timings(settings)
    return LeaderElector(
        kube_api_client(),
        settings.namespace,
        settings.lease_name,
        settings.replica_id or socket.gethostname(),
        lease_duration=settings.lease_duration_seconds,
        renew_deadline=settings.lease_renew_deadline_seconds,
        retry_period=settings.lease_retry_period_seconds,
        on_started_leading=on_started,
        on_stopped_leading=on_stopped,
    )
