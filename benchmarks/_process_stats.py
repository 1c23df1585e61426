"""What a soak reads from a process, and how it judges a series of readings.

Readings: RSS, open file descriptors, threads and child processes (psutil, from any process);
malloc's bytes in use and the live Python objects (from inside the process). Judgements: the
least-squares slope of a series, the rise of its floor, and a per-metric verdict.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import math
import os
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import psutil

__all__ = [
    "MIN_SAMPLES",
    "MIN_SPAN",
    "OBJECTS_FLOOR",
    "RSS_SLOPE_MIB",
    "growth",
    "live_objects",
    "peak_rss_above_start",
    "read_process",
    "reset_high_water_mark",
    "rss_and_hwm",
    "summarize",
    "traced_growth",
    "trim_heap",
    "type_counts",
]

RSS_SLOPE_MIB = 2.0  # per 100 steps, for RSS and malloc in use
OBJECTS_FLOOR = 100.0  # live Python objects, per 100 steps
MIN_SAMPLES, MIN_SPAN = 5, 100  # samples and steps after the warm-up, for a trend's verdict


def read_process(pid: int) -> dict[str, float]:
    """RSS (MiB), open fds, threads and child processes (all descendants) of ``pid``."""
    proc = psutil.Process(pid)
    with proc.oneshot():
        return {
            "rss_mib": proc.memory_info().rss / 2**20,
            "fds": proc.num_fds(),
            "threads": proc.num_threads(),
            "children": len(proc.children(recursive=True)),
        }


_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_rss_above_start(run: Callable[[], Any], pids: Sequence[int]) -> list[int]:
    """For each of ``pids``: its peak resident bytes during ``run()`` above its level just
    before, sampled every millisecond from ``/proc/<pid>/statm`` (Linux). A freed tensor
    lowers RSS only if the allocator returns it (start processes with ``MALLOC_MMAP_THRESHOLD_``
    set, so big buffers are mapped and unmapped, not kept in the heap)."""
    start = [_rss(pid) for pid in pids]
    peak, done = list(start), threading.Event()

    def sample() -> None:
        while not done.is_set():
            for i, pid in enumerate(pids):
                peak[i] = max(peak[i], _rss(pid))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    return [max(p, _rss(pid)) - s for p, pid, s in zip(peak, pids, start, strict=True)]


def live_objects() -> int:
    """Python objects the garbage collector tracks, after a collection."""
    gc.collect()
    return len(gc.get_objects())


def type_counts() -> Counter[str]:
    """Live gc-tracked objects by type, after a collection."""
    gc.collect()
    return Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())


def growth(before: Counter[str], after: Counter[str], top: int = 8) -> dict[str, int]:
    """The types whose live count grew most between two censuses."""
    delta = after.copy()
    delta.subtract(before)
    return {k: v for k, v in delta.most_common(top) if v > 0}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def trim_heap() -> float:
    """Hand the free memory malloc keeps back to the system (glibc ``malloc_trim``) and return
    malloc's bytes in use, in MiB: every arena's allocated chunks plus mmapped ones (torch's CPU
    tensors included), i.e. what the process holds, not what the allocator keeps after frees.
    NaN where the C library is not glibc >= 2.33."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim(0)
        info = libc.mallinfo2()
    except (OSError, AttributeError, TypeError):
        return float("nan")
    return float(info.uordblks + info.hblkhd) / 2**20


def traced_growth(top: int = 5, frames: int = 6) -> dict[str, Any]:
    """What the allocations made since ``tracemalloc.start()`` and still alive add up to, and
    the sites holding the most of it: size, count, and the innermost ``frames`` frames."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)]
    )
    stats = snapshot.statistics("traceback")
    return {
        "total_kib": round(sum(s.size for s in stats) / 1024, 1),
        "top": [
            {
                "kib": round(stat.size / 1024, 1),
                "count": stat.count,
                "frames": [f"{f.filename}:{f.lineno}" for f in list(stat.traceback)[-frames:]],
            }
            for stat in stats[:top]
        ],
    }


def _slope_per_100(steps: list[int], values: list[float]) -> float:
    if len(steps) < 2 or any(math.isnan(v) for v in values):
        return float("nan")
    return float(np.polyfit(np.asarray(steps, float), np.asarray(values, float), 1)[0] * 100)


def _floor_growth_per_100(steps: list[int], values: list[float]) -> float:
    """How fast the floor rises: the minimum of the last third of the samples minus that of
    the first third, per 100 steps between the thirds' middles. Caches that fill and purge
    (torch keeps up to ~128 weak references to storages received from other processes, then
    drops the dead ones) make a sawtooth whose slope depends on where the run stops; a leak
    raises the floor."""
    k = max(1, len(steps) // 3)
    span = (steps[-k:][len(steps[-k:]) // 2] - steps[:k][k // 2]) or 1
    return (min(values[-k:]) - min(values[:k])) / span * 100


def _trend_verdict(rate: float, limit: float, long_enough: bool) -> str:
    if not long_enough:
        return "too short to tell"
    if math.isnan(rate):
        return "not measured"
    return "flat" if rate < limit else "growing"


def summarize(steps: list[int], series: dict[str, list[float]]) -> dict[str, Any]:
    """First / last / max, trends and verdicts of one process's samples taken at ``steps``."""
    out: dict[str, Any] = {}
    for key in ("rss_trimmed_mib", "rss_mib", "malloc_in_use_mib"):
        values = series[key]
        out[key] = {
            "first": round(values[0], 1),
            "last": round(values[-1], 1),
            "max": round(max(values), 1),
            "slope_per_100_steps": round(_slope_per_100(steps, values), 2),
            # growth that stops in the first half (a late warm-up, a cache filling) is bounded
            "slope_last_half_per_100_steps": round(
                _slope_per_100(steps[len(steps) // 2 :], values[len(values) // 2 :]), 2
            ),
        }
    objects = series["live_objects"]
    out["live_objects"] = {
        "first": int(objects[0]),
        "last": int(objects[-1]),
        "max": int(max(objects)),
        "floor_growth_per_100_steps": round(_floor_growth_per_100(steps, objects), 1),
    }
    for key in ("fds", "threads", "children"):
        values = series[key]
        out[key] = {"first": int(values[0]), "last": int(values[-1]), "max": int(max(values))}

    long_enough = len(steps) >= MIN_SAMPLES and steps[-1] - steps[0] >= MIN_SPAN
    # memory grows when it rises over the whole span and still rises over its second half
    verdict = {
        name: _trend_verdict(
            min(out[key]["slope_per_100_steps"], out[key]["slope_last_half_per_100_steps"]),
            RSS_SLOPE_MIB,
            long_enough,
        )
        for name, key in (("rss", "rss_trimmed_mib"), ("malloc_in_use", "malloc_in_use_mib"))
    }
    verdict["live_objects"] = _trend_verdict(
        out["live_objects"]["floor_growth_per_100_steps"], OBJECTS_FLOOR, long_enough
    )
    for key in ("fds", "threads", "children"):
        verdict[key] = "flat" if out[key]["last"] <= out[key]["first"] else "growing"
    out["verdict"] = verdict
    for key in ("rss_trimmed_mib", "rss_mib", "malloc_in_use_mib"):
        out[key]["series"] = [round(v, 1) for v in series[key]]
    out["live_objects"]["series"] = [int(v) for v in objects]
    return out


def rss_and_hwm() -> tuple[int, int]:
    """This process's resident set and its high-water mark, in bytes (Linux ``/proc``)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def reset_high_water_mark() -> int:
    """Hand malloc's free memory back to the system (:func:`trim_heap`), reset the resident-set
    high-water mark to the current resident set and return that, in bytes: what a step's
    memory rise is measured from."""
    trim_heap()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss_and_hwm()[0]
