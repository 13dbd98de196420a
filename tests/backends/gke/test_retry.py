"""Retry policy of Kubernetes API calls: what is retried, the backoff's growth and cap, the deadline."""

from __future__ import annotations

import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from multislice.backends.gke import retry


class Flaky:
    """Fails with the given errors in turn, then returns "ok"."""

    def __init__(self, *errors):
        self.errors, self.calls = list(errors), 0

    def __call__(self):
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def too_many(retry_after=None):
    error = ApiException(status=429, reason="Too Many Requests")
    error.headers = {"Retry-After": retry_after} if retry_after else {}
    return error


def test_connection_resets_429_and_5xx_back_off_exponentially_up_to_the_cap():
    waits = []
    reset = urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))
    fn = Flaky(reset, too_many(), ApiException(status=503), ApiException(status=500), ApiException(status=502))
    result = retry.call(retry.RetryPolicy(initial=1, maximum=4, deadline=60), fn, sleep=waits.append)
    assert result == "ok" and fn.calls == 6
    assert waits == [1, 2, 4, 4, 4]


def test_retry_after_is_honoured_within_the_cap():
    waits = []
    retry.call(retry.RetryPolicy(initial=1, maximum=10, deadline=60), Flaky(too_many("7")), sleep=waits.append)
    assert waits == [7]


def test_other_statuses_are_raised_at_once():
    fn = Flaky(ApiException(status=409, reason="Conflict"))
    with pytest.raises(ApiException) as failure:
        retry.call(retry.RetryPolicy(), fn, sleep=lambda s: None)
    assert failure.value.status == 409 and fn.calls == 1


def test_the_deadline_ends_retries_with_the_last_error():
    fn = Flaky(*[ApiException(status=503, reason="Service Unavailable")] * 100)
    with pytest.raises(
        retry.ApiUnavailable, match=r"get JobSet x failed 1 time within its 0.5 s retry deadline, last with HTTP 503"
    ):
        retry.call(retry.RetryPolicy(initial=1, maximum=1, deadline=0.5), fn, what="get JobSet x", sleep=lambda s: None)
