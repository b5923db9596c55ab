"""When each request of an open-loop run is sent: upstream's --request-rate and --burstiness.

Gaps between consecutive requests are i.i.d. Gamma(shape=b, scale=1 / (rate * b)), mean 1 / rate:
  b = 1    exponential gaps, a Poisson process (the default)
  b < 1    burstier (clusters, then lulls)
  b > 1    more even
  b = inf  constant gaps of exactly 1 / rate (constant-rate arrivals)
An infinite rate sends every request at once. The first request goes at time 0.
"""
import asyncio
import math
import time
from typing import AsyncIterator, Optional, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0,
                  rng: Optional[np.random.Generator] = None) -> np.ndarray:
    """Seconds after the start at which each request is sent, non-decreasing."""
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        return np.arange(num_requests) / request_rate
    rng = rng if rng is not None else np.random.default_rng(0)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness),
                     size=max(num_requests - 1, 0))
    return np.concatenate([np.zeros(min(num_requests, 1)), np.cumsum(gaps)])


async def get_request(input_requests: Sequence[T], times: Sequence[float]) -> AsyncIterator[T]:
    """Yield each request at its arrival time (seconds after the first is yielded)."""
    start = time.perf_counter()
    for request, at in zip(input_requests, times):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield request
