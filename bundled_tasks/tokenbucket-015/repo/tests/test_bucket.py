import pytest

from ratelimit import TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_burst_up_to_capacity_then_refuse():
    bucket = TokenBucket(rate_per_s=1, capacity=3, clock=FakeClock())
    assert [bucket.try_acquire() for _ in range(4)] == [True, True, True, False]


def test_tokens_refill_over_time():
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=2, capacity=4, clock=clock)
    for _ in range(4):
        bucket.try_acquire()
    clock.now += 1.0
    assert bucket.available() == pytest.approx(2.0)
    assert bucket.wait_time_s(3) == pytest.approx(0.5)


def test_request_larger_than_capacity_is_an_error():
    with pytest.raises(ValueError):
        TokenBucket(1, 2, clock=FakeClock()).try_acquire(5)
