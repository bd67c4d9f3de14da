"""Learning rate per optimizer update (juno's `--lora-lr-schedule`).

Counted in optimizer updates, one-based, after accumulation grouping: update `u` of `total`
gets `lr(u)`. Warmup-cosine rises linearly over `warmup` updates to the peak, then follows a
half cosine from the peak down to `min_lr` at the last update:

    u <= warmup:  peak * u / warmup
    otherwise:    min_lr + (peak - min_lr) * (1 + cos(pi * (u - warmup) / (total - warmup))) / 2
"""

from __future__ import annotations

import math

from lorafleet_controller.jobs.params import Schedule


def learning_rate(
    schedule: Schedule, peak: float, update: int, total: int, warmup: int = 0, min_lr: float = 0.0
) -> float:
    if update < 1:
        raise ValueError(f"updates are numbered from 1, got {update}")
    if schedule == Schedule.CONSTANT:
        return peak
    if update <= warmup:
        return peak * update / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (update - warmup) / span)
    return min_lr + (peak - min_lr) * (1.0 + math.cos(math.pi * progress)) / 2.0
