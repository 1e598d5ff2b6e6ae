"""Peak-RSS growth of code run in a fresh process (Linux), for the memory-bound tests.

glibc is told to ``mmap`` every allocation over 64 KiB and to trim on free, so RSS follows live
memory (otherwise freed blocks stay in the heap and a measurement under-reports); the peak
counter ``VmHWM`` is reset through ``/proc/self/clear_refs`` right before the measured call.
"""

import json
import os
import subprocess
import sys
import textwrap

HAS_PEAK_RESET = os.path.exists("/proc/self/clear_refs")

_PRELUDE = '''
import gc, json, torch
torch.set_num_threads(2)

def kib(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))

def peak_growth(fn):
    """(peak RSS growth in MB during fn(), its result)"""
    gc.collect()
    base = kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    out = fn()
    return (kib("VmHWM:") - base) / 1024, out
'''


def run_measured(body: str, timeout: float = 600) -> dict:
    """Run ``body`` (which may call ``peak_growth``) in a fresh interpreter; the JSON of its last line."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=timeout,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
