"""Per-caller rate limit (`--rate-limit` requests per second, `--rate-burst` at once): one token
bucket per API key, or per client IP when the server has no key. A refused request is told how
many whole seconds to wait (`Retry-After`, rounded up)."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    """`burst` tokens at most, refilled at `rate` a second; a request takes one."""

    rate: float
    burst: int
    tokens: float
    updated: float

    def take(self, now: float) -> float:
        """0.0 if a token was taken, else the seconds until one will be there."""
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


class RateLimiter:
    """Token buckets by caller. The least recently seen callers are forgotten past `max_callers`
    (a forgotten caller starts again with a full bucket), so many client IPs cannot grow memory
    without bound."""

    def __init__(self, rate: float, burst: int, max_callers: int = 100_000, clock=time.monotonic):
        self.rate, self.burst, self.max_callers, self.clock = rate, burst, max_callers, clock
        self._buckets: OrderedDict[Hashable, TokenBucket] = OrderedDict()

    def check(self, caller: Hashable) -> int:
        """0 if `caller` may go on now, else the whole seconds to wait (at least 1)."""
        now = self.clock()
        bucket = self._buckets.get(caller)
        if bucket is None:
            bucket = self._buckets[caller] = TokenBucket(self.rate, self.burst, float(self.burst), now)
            if len(self._buckets) > self.max_callers:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(caller)
        wait = bucket.take(now)
        return max(1, math.ceil(wait)) if wait > 0 else 0
