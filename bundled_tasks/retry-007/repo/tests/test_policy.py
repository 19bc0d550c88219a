import pytest

from backoff_retry import RetryPolicy, call_with_retry, retry


class Flaky:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise ConnectionError("down")
        return "ok"


def test_succeeds_after_failures():
    slept = []
    flaky = Flaky(2)
    assert call_with_retry(flaky, RetryPolicy(attempts=3), sleep=slept.append) == "ok"
    assert flaky.calls == 3
    assert slept == [0.5, 1.0]


def test_other_errors_propagate_immediately():
    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError):
        call_with_retry(boom, RetryPolicy(retry_on=(ConnectionError,)), sleep=lambda s: None)


def test_delay_is_capped():
    policy = RetryPolicy(base_delay_s=1.0, factor=10.0, max_delay_s=5.0)
    assert [policy.delay_s(n) for n in (1, 2, 3)] == [1.0, 5.0, 5.0]


def test_decorator_passes_arguments():
    @retry(RetryPolicy(attempts=2), sleep=lambda s: None)
    def add(a, b=0):
        return a + b

    assert add(2, b=3) == 5
