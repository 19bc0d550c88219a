import pytest

from backoff_retry import RetryError, RetryPolicy, call_with_retry


def always_down():
    raise TimeoutError("still down")


def test_no_sleep_after_final_failure():
    slept = []
    with pytest.raises(RetryError) as info:
        call_with_retry(always_down, RetryPolicy(attempts=3), sleep=slept.append)
    assert slept == [0.5, 1.0]
    assert info.value.attempts == 3
    assert isinstance(info.value.__cause__, TimeoutError)


def test_single_attempt_never_sleeps():
    slept = []
    with pytest.raises(RetryError):
        call_with_retry(always_down, RetryPolicy(attempts=1), sleep=slept.append)
    assert slept == []


def test_on_retry_only_announces_real_retries():
    seen = []
    with pytest.raises(RetryError):
        call_with_retry(always_down, RetryPolicy(attempts=2), sleep=lambda s: None,
                        on_retry=lambda n, e: seen.append(n))
    assert seen == [1]
