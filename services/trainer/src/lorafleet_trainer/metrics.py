"""The trainer's Prometheus metrics (default registry, bounded labels), defined once."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SLOTS = Gauge("lorafleet_trainer_slots", "LoRA slots by state.", ["state"])
TOKENS = Counter("lorafleet_trainer_tokens_total", "Tokens trained (forward_backward datums).")
FORWARD_TOKENS = Counter(
    "lorafleet_trainer_forward_tokens_total",
    "Tokens the forward computed: datum (every datum's own tokens) and context (truncated-BPTT "
    "context not carried from the window before, so computed again).",
    ["kind"],
)
OPTIM_STEPS = Counter("lorafleet_trainer_optim_steps_total", "Applied optimizer steps.")
NONFINITE_VETOES = Counter(
    "lorafleet_trainer_nonfinite_vetoes_total", "optim_steps vetoed by a non-finite gradient."
)
OP_SECONDS = Histogram(
    "lorafleet_trainer_op_seconds",
    "Engine time per operation.",
    ["kind"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
STATE_IO_SECONDS = Histogram(
    "lorafleet_trainer_state_io_seconds",
    "Time to save/load/export/import state.",
    ["op"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 120),
)
