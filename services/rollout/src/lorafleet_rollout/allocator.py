"""glibc malloc settings for a process that runs the torch engine.

A prefill step's activations are a few MB each ([512 tokens, 3,072] floats is 6 MB). glibc
serves allocations that big with a fresh mmap and unmaps them when freed, so every step
faults its activations' pages in again: a cold round of workload (c) (4 x 1,500-token
prompts, bench model) took ~170 k minor faults. With the mmap threshold at its ceiling and
freed memory kept, they come from the heap and are reused: ~40 k faults (the rest are new
prefix-cache entries, which must be new memory), and the round ran ~8 % faster (2.4 -> 2.2 s,
measured side by side). vLLM's CPU backend preloads tcmalloc for the same reason.

Process-wide and best effort: where the C library is not glibc nothing changes (logged).

Freed memory must also stay in the process. On our VMs a page the process has not touched
yet costs ~3 us to fault in (2 GB: 6 s), host-side, even when the guest freed it a moment
ago: memory given back to the system is returned to the host. So the first batch after an
idle decode cache was dropped, or beside another process holding a few GB (a stopped vLLM, a
3 GB tensor in a stopped process), ran 16-30 % slower (a cold round of workload (c): 3.4 ->
4.0-4.5 s, measured). mallopt cannot fix that once threads have their arenas, so the rollout
process starts with `TUNABLES` in GLIBC_TUNABLES (`exec_with_tunables`): one arena, no
mmapped chunks, no trimming, so what the engine frees is what it allocates next. `warm`
then faults in, at start-up, memory the first batches will use (as vLLM allocates its KV
cache space at start-up): with both, that cold round ran in 3.1 s beside the 3 GB.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import sys
import time

log = logging.getLogger(__name__)

#: mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Allocations below this come from the heap: glibc's ceiling on 64-bit (larger values are
#: refused). Bigger ones (a long prompt's keys/values) go through `kv_pool.KvPool`.
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of a heap kept for reuse instead of being returned to the system.
TRIM_THRESHOLD = 1 << 30
#: glibc tunables the rollout process starts with (see the module's docstring): one arena
#: (the scheduler thread's frees serve its next allocations whichever thread made them), no
#: mmapped chunks (those are unmapped when freed), and no trimming of the heap's top.
TUNABLES = {
    "glibc.malloc.arena_max": "1",
    "glibc.malloc.mmap_max": "0",
    "glibc.malloc.trim_threshold": str(1 << 40),
}
#: `TUNABLES` as GLIBC_TUNABLES spells them.
TUNABLES_ENV = ":".join(f"{k}={v}" for k, v in TUNABLES.items())
#: Bytes `warm` touches per tensor.
_WARM_CHUNK = 256 << 20


def keep_freed_memory() -> bool:
    """Apply the settings above to this process; whether the C library took them. A process
    started with `TUNABLES` keeps those (a 1 GB trim threshold here would hand back what
    `warm` faulted in beyond it)."""
    if tunables_active():
        return True
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        log.info("no glibc mallopt: malloc settings left as they are")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not applied:
        log.warning("mallopt refused the engine's malloc settings: left as they are")
    return applied


def exec_with_tunables() -> None:
    """Re-execute this process with `TUNABLES` added to GLIBC_TUNABLES, unless they are there
    (this is the re-executed process) or set otherwise by the user, or the C library is not
    glibc. Call first thing, before threads or big allocations: the process is replaced."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    named = {item.split("=", 1)[0] for item in current.split(":") if item}
    if platform.libc_ver()[0] != "glibc" or named & TUNABLES.keys():
        return
    env = {**os.environ, "GLIBC_TUNABLES": f"{current}:{TUNABLES_ENV}" if current else TUNABLES_ENV}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def tunables_active() -> bool:
    """Whether this process started with `TUNABLES` (what `exec_with_tunables` sets)."""
    current = os.environ.get("GLIBC_TUNABLES", "")
    return set(TUNABLES_ENV.split(":")) <= set(current.split(":"))


def warm(nbytes: int) -> float:
    """Fault in `nbytes` of heap and free it, so the first batches reuse those pages instead
    of faulting in their own; seconds taken. Kept by the process only with `TUNABLES`
    (without them it is returned to the system and the call is nearly useless: logged)."""
    import torch  # the module stays importable before torch loads (exec_with_tunables)

    if nbytes <= 0:
        return 0.0
    if not tunables_active():
        log.warning("warming %d bytes without GLIBC_TUNABLES %s: not kept", nbytes, TUNABLES)
    start = time.perf_counter()
    chunks = []
    for first in range(0, nbytes, _WARM_CHUNK):
        chunks.append(torch.zeros(min(_WARM_CHUNK, nbytes - first) // 4, dtype=torch.float32))
    del chunks
    return time.perf_counter() - start
