"""Prometheus metrics of the rollout service, defined once (default registry, bounded labels)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

ADAPTERS_LOADED = Gauge(
    "lorafleet_rollout_adapters_loaded", "Adapter versions loaded in the engine."
)
TOKENS = Counter("lorafleet_rollout_tokens_total", "Tokens generated (all sequences).")
TTFT = Histogram(
    "lorafleet_rollout_ttft_seconds",
    "Time from a request entering the engine queue to its first token (torch engine).",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
QUEUE_DEPTH = Gauge(
    "lorafleet_rollout_queue_depth", "Sample requests admitted by the service and not yet done."
)
REQUESTS = Counter(
    "lorafleet_rollout_requests_total",
    "Sample requests by outcome.",
    ["outcome"],  # ok, invalid, not_found, exhausted, cancelled, error
)
PROMPT_TOKENS = Counter(
    "lorafleet_rollout_prompt_tokens_total",
    "Prompt tokens of admitted requests by how they were served (torch engine): computed, "
    "or reused from the prefix cache.",
    ["source"],  # computed, cached
)
ADAPTER_PUSHES = Counter(
    "lorafleet_rollout_adapter_pushes_total",
    "Adapter versions received, by how their files came: streamed through the controller, or "
    "read by this replica from shared storage (publish by reference).",
    ["via"],  # stream, shared
)
DECODE_ROWS = Counter(
    "lorafleet_rollout_decode_rows_total",
    "Rows of decode steps (torch engine) by where their prompt prefix's keys/values are read: "
    "a segment shared with other rows (read once for all of them), or the row's own slot.",
    ["prefix"],  # shared, own
)
DECODE_KERNELS = Gauge(
    "lorafleet_rollout_decode_kernels",
    "1 for the decode kernels the torch engine runs: a native build variant (x86-64-v4 with "
    "AVX-512, x86-64-v3) or the torch fallback (installed without a compiler, another CPU).",
    ["path"],  # x86-64-v4, x86-64-v3, torch
)
ADAPTERS_STORED = Gauge(
    "lorafleet_rollout_adapters_stored",
    "Adapter versions this replica holds on disk and serves, loaded in the engine or not.",
)
ADAPTER_LOOKUPS = Counter(
    "lorafleet_rollout_adapter_lookups_total",
    "Sample requests on an adapter, by whether it was in the engine (hit) or had to be "
    "loaded first (miss).",
    ["result"],  # hit, miss
)
ADAPTER_LOADS = Counter(
    "lorafleet_rollout_adapter_loads_total",
    "Adapter versions loaded into the engine, by cause: a publish, or a sample of a version "
    "that was evicted.",
    ["cause"],  # publish, sample
)
ADAPTER_EVICTIONS = Counter(
    "lorafleet_rollout_adapter_evictions_total",
    "Idle adapter versions taken out of the engine to make room (their files stay).",
)
ADAPTER_LOAD_SECONDS = Histogram(
    "lorafleet_rollout_adapter_load_seconds",
    "Time to load one adapter version into the engine.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
