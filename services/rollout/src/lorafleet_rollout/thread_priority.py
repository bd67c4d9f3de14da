"""Thread priorities of a replica that decodes in-process (the torch engine): the decoding
thread must win the GIL and the cores back from the replica's other threads (gRPC, staging,
hashing and preparing a publish), which would otherwise slow every running request."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

#: Python's GIL switch interval while this engine runs. The scheduler thread gives the GIL up
#: in every torch op and must win it back from the gRPC loop and the adapter-prep thread, which
#: run Python while a publish streams in; at the default 5 ms a decode step beside a busy Python
#: thread took 2.6x its quiet time, at 0.5 ms 1.6x (measured side by side, bench model).
SWITCH_INTERVAL = 0.0005
#: Niceness of a replica's threads other than the decoding one (0 = normal, 19 = least).
#: Others' throughput under back-to-back publishing, median of 6 rounds (bench/sampling.py,
#: 2 replicas and the publisher on 2 cores): 0.75 all equal, 0.79 at 10, 0.84 at 19, within
#: the noise; but at 19 a publish during sampling took 0.6 s (p50) against 0.15-0.22 s at 10.
#: SCHED_IDLE was worse (0.62: a starved thread holding the GIL stalls the decoding one).
NICE = 10


def shorten_switch_interval() -> None:
    """At most `SWITCH_INTERVAL` from now on, for the whole process."""
    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))


def lower_priority() -> None:
    """Nice the calling thread (Linux schedules threads individually); best effort."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)


def lower_all_but(decoding: int) -> None:
    """Nice every thread of this process but the decoding one; threads started later inherit
    it from the thread that starts them. A replica's other threads (gRPC, staging, hashing a
    publish) then take mostly CPU decoding leaves (see `NICE`). Best effort: without /proc
    (not Linux) nothing changes."""
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            if int(task) != decoding:
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(task), NICE)
