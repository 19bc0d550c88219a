"""Retrying a call with exponential backoff."""
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


class RetryError(Exception):
    """Raised when every attempt failed; the last error is the __cause__."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3
    base_delay_s: float = 0.5
    factor: float = 2.0
    max_delay_s: float = 30.0
    retry_on: tuple[type[BaseException], ...] = (Exception,)

    def delay_s(self, failed_attempt: int) -> float:
        """Pause after the *failed_attempt*-th failure (1-based)."""
        return min(self.max_delay_s, self.base_delay_s * self.factor ** (failed_attempt - 1))


def call_with_retry(
    fn: Callable[[], T],
    policy: RetryPolicy = RetryPolicy(),
    *,
    sleep: Callable[[float], None] = time.sleep,
    on_retry: Callable[[int, BaseException], None] | None = None,
) -> T:
    """Call *fn* until it succeeds or *policy.attempts* calls have failed.

    Between two attempts, *on_retry(failed_attempt, error)* is called and
    then the policy's delay is slept. Errors not listed in
    *policy.retry_on* propagate at once.
    """
    last_error: BaseException | None = None
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except policy.retry_on as exc:
            last_error = exc
            if attempt == policy.attempts:
                break
            if on_retry is not None:
                on_retry(attempt, exc)
            sleep(policy.delay_s(attempt))
    raise RetryError(f"gave up after {policy.attempts} attempts", policy.attempts) from last_error


def retry(policy: RetryPolicy = RetryPolicy(), *, sleep: Callable[[float], None] = time.sleep):
    """Decorator form of call_with_retry()."""

    def decorate(fn: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            return call_with_retry(lambda: fn(*args, **kwargs), policy, sleep=sleep)

        return wrapper

    return decorate
