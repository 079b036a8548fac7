"""Timing helpers the benchmarks share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax


def best(fn: Callable[[], Any], setup: Callable[[], Any] | None = None, repeats: int = 5) -> float:
    """The fastest of `repeats` runs of `fn`, in seconds, each after an untimed `setup` (the machine is noisy)."""
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def per_call(fn: Callable[..., Any], args: tuple, calls: int) -> float:
    """Mean seconds per call of `fn(*args)` over `calls` calls, after one untimed call (which compiles)."""
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls
