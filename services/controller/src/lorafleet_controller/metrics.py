"""The controller's Prometheus metrics, defined once (default registry, bounded labels)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LEDGER_OPERATIONS = Gauge("lorafleet_ledger_operations", "Ledger operations per state.", ["state"])
OPERATION_LATENCY = Histogram(
    "lorafleet_operation_latency_seconds",
    "Submission to terminal state, per operation kind.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
GAP_STALLS = Gauge("lorafleet_ledger_gap_stalls", "Registrations waiting for a missing seq_id.")
BACKPRESSURE = Counter(
    "lorafleet_ledger_backpressure_total",
    "Submissions refused with RESOURCE_EXHAUSTED, by limit.",
    ["scope"],
)
REGISTRY_SLOTS = Gauge(
    "lorafleet_registry_slots", "Trainer slots per replica and state.", ["replica", "state"]
)
REGISTRY_QUEUED = Gauge("lorafleet_registry_queued", "Registrations waiting for a trainer slot.")
ADMISSION_LOAD = Gauge(
    "lorafleet_admission_load",
    "What the fleet holds against its admission limits: open operations (pending), "
    "unacknowledged results (unacked) and their bytes (pending_bytes, unacked_bytes).",
    ["kind"],
)
ADMISSION_LIMIT = Gauge(
    "lorafleet_admission_limit",
    "The fleet's admission limit of each kind of lorafleet_admission_load (the MAX_*_GLOBAL "
    "settings); a submission past one is refused with backpressure.",
    ["kind"],
)
PUBLISH_LATENCY = Histogram(
    "lorafleet_publish_latency_seconds",
    "save_weights_for_sampler: export plus every rollout acknowledging.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
PAGE_OUTS = Counter(
    "lorafleet_registry_page_outs_total",
    "Training runs paged out of their trainer slot, by trigger (idle, forced).",
    ["trigger"],
)
PAGE_INS = Counter("lorafleet_registry_page_ins_total", "Paged runs restored into a slot.")
PAGE_OUT_SECONDS = Histogram(
    "lorafleet_registry_page_out_seconds",
    "Page-out: the trainer's snapshot of the slot until its slot is free.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
PAGE_IN_SECONDS = Histogram(
    "lorafleet_registry_page_in_seconds",
    "Page-in: the restore of a paged run into its new slot (bind, load, replay).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
