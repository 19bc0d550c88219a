import pytest

from ratelimit import TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_idle_time_does_not_allow_bigger_bursts():
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=10, capacity=5, clock=clock)
    clock.now += 60
    granted = sum(bucket.try_acquire() for _ in range(20))
    assert granted == 5


def test_available_never_exceeds_capacity():
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=1, capacity=2, clock=clock)
    bucket.try_acquire()
    clock.now += 30
    assert bucket.available() == pytest.approx(2.0)


def test_wait_time_after_idle_burst():
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=4, capacity=2, clock=clock)
    clock.now += 10
    assert bucket.try_acquire(2)
    assert bucket.wait_time_s(1) == pytest.approx(0.25)


def test_partial_refill_is_not_capped_early():
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=1, capacity=10, clock=clock)
    bucket.try_acquire(8)
    clock.now += 3
    assert bucket.available() == pytest.approx(5.0)
