from backoff_retry.policy import RetryError, RetryPolicy, call_with_retry, retry

__all__ = ["RetryError", "RetryPolicy", "call_with_retry", "retry"]
