"""The rollout process's heap settings (`allocator.py`), in real child processes: the
re-exec that installs them, and what they are for, freed memory staying in the process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from lorafleet.testing import child_env
from lorafleet_rollout.allocator import TUNABLES, TUNABLES_ENV

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc tunables")

#: Prints the resident MB `warm` left behind (more than keep_freed_memory's 1 GB trim
#: threshold, which the tunables override), then those freeing 256 MB it had touched gave back.
KEPT = """
import torch
from lorafleet_rollout.allocator import keep_freed_memory, warm
keep_freed_memory()  # as the engine calls it: must not undo the tunables
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
base = rss_mb()
warm(1280 << 20)
warmed = rss_mb()
x = torch.zeros(64 << 20)
before = rss_mb()
del x
print(warmed - base, before - rss_mb())
"""


def run(code: str, **env: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(**env), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_the_process_restarts_once_with_the_tunables() -> None:
    code = (
        "import os\n"
        "from lorafleet_rollout.allocator import exec_with_tunables, tunables_active\n"
        "print(tunables_active())\n"
        "exec_with_tunables()\n"
        "print(os.environ['GLIBC_TUNABLES'])\n"
    )
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True
    )
    first, second, tunables = out.stdout.split()
    assert (first, second) == ("False", "True")  # the code ran twice: before and after exec
    assert set(tunables.split(":")) == {f"{k}={v}" for k, v in TUNABLES.items()}
    assert tunables == TUNABLES_ENV
    # A user's own malloc tunables win: no re-exec, theirs kept.
    mine = run(code, GLIBC_TUNABLES="glibc.malloc.arena_max=4")
    assert mine == ["False", "glibc.malloc.arena_max=4"]


def test_freed_memory_stays_only_with_the_tunables() -> None:
    warmed, released = map(int, run(KEPT, GLIBC_TUNABLES=TUNABLES_ENV))
    assert warmed >= 1200  # warm's 1,280 MB stayed resident, for the next allocations
    assert released < 16  # so did the 256 MB once freed
    warmed, released = map(int, run(KEPT, GLIBC_TUNABLES="glibc.malloc.check=0"))
    assert warmed < 16 and released >= 240  # glibc's default: unmapped when freed
