"""Token-bucket rate limiting with an injectable clock."""
import time
from collections.abc import Callable


class TokenBucket:
    """Allows bursts of up to *capacity* requests and *rate_per_s* on average.

    The bucket starts full. Tokens flow in continuously at *rate_per_s*
    but the bucket never holds more than *capacity* of them.
    """

    def __init__(self, rate_per_s: float, capacity: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or capacity <= 0:
            raise ValueError("rate_per_s and capacity must be positive")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._clock = clock
        self._tokens = float(capacity)
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens += (now - self._last) * self.rate_per_s
        self._last = now

    def available(self) -> float:
        self._refill()
        return self._tokens

    def try_acquire(self, tokens: float = 1) -> bool:
        """Take *tokens* if they are available now; never blocks."""
        if tokens > self.capacity:
            raise ValueError(f"cannot take {tokens} tokens from a bucket of capacity {self.capacity}")
        self._refill()
        if self._tokens >= tokens:
            self._tokens -= tokens
            return True
        return False

    def wait_time_s(self, tokens: float = 1) -> float:
        """Seconds until *tokens* will be available (0 if they are now)."""
        self._refill()
        missing = tokens - self._tokens
        return max(0.0, missing / self.rate_per_s)
