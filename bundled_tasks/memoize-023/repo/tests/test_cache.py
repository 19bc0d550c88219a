from memo import CacheInfo, memoize


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_positional_calls_are_cached():
    calls = []

    @memoize()
    def square(x):
        calls.append(x)
        return x * x

    assert [square(3), square(3), square(4)] == [9, 9, 16]
    assert calls == [3, 4]
    assert square.cache_info() == CacheInfo(hits=1, misses=2, size=2)


def test_entries_expire():
    clock = FakeClock()

    @memoize(ttl_s=10, clock=clock)
    def now_value():
        return clock.now

    assert now_value() == 0.0
    clock.now = 9.0
    assert now_value() == 0.0
    clock.now = 10.0
    assert now_value() == 10.0


def test_keyword_order_does_not_matter():
    calls = []

    @memoize()
    def f(a=0, b=0):
        calls.append((a, b))
        return a - b

    assert f(a=5, b=2) == f(b=2, a=5) == 3
    assert len(calls) == 1
