"""Retrying Kubernetes API calls: capped exponential backoff on 429, 5xx and connection resets.

What is retried follows the API conventions
(https://kubernetes.io/docs/reference/using-api/api-concepts/#retrying and
``Status`` codes in https://kubernetes.io/docs/reference/kubernetes-api/common-definitions/status/):
429 Too Many Requests (honouring ``Retry-After``, capped), 500, 502, 503 and
504, and transport failures (connection refused or reset, a dropped stream).
Anything else (400, 403, 404, 409, 422, ...) is the caller's to handle and is
raised at once.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes.client.exceptions import ApiException

from multislice.errors import RunFailed

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
TRANSPORT_ERRORS = (urllib3.exceptions.HTTPError, ConnectionError, http.client.HTTPException, TimeoutError)


class ApiUnavailable(RunFailed):
    """The Kubernetes API kept failing past the retry deadline; the message has the last error."""


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for one API call, seconds: ``initial``, doubled per failure up to ``maximum``, until ``deadline``."""

    initial: float = 1.0
    maximum: float = 30.0
    deadline: float = 300.0


def retryable(error: BaseException) -> bool:
    """True for 429, 5xx (the codes above) and transport errors."""
    if isinstance(error, ApiException):
        return error.status in RETRYABLE_STATUS or error.status == 0
    return isinstance(error, TRANSPORT_ERRORS)


def describe(error: BaseException) -> str:
    """One line for an API error: status, reason and the Status message when there is one."""
    if isinstance(error, ApiException):
        return f"HTTP {error.status} {error.reason}".strip()
    return f"{type(error).__name__}: {error}"


def _retry_after(error: BaseException) -> float | None:
    if isinstance(error, ApiException) and error.headers:
        value = error.headers.get("Retry-After")
        if value and value.isdigit():
            return float(value)
    return None


def call[T](
    policy: RetryPolicy,
    fn: Callable[..., T],
    *args: Any,
    what: str = "",
    on_retry: Callable[[str], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    **kwargs: Any,
) -> T:
    """Call ``fn(*args, **kwargs)``, retrying retryable failures with capped exponential backoff.

    Args:
        policy: Delays and deadline, seconds.
        fn: The API method.
        what: What the call does, for messages ("get JobSet x").
        on_retry: Told one line per retry.
        sleep: The sleep function (tests may pass a fake).

    Returns:
        ``fn``'s result.

    Raises:
        ApiUnavailable: still failing after ``policy.deadline`` seconds.
        kubernetes.client.exceptions.ApiException: a status that is not retried (404, 409, ...).
    """
    deadline = time.monotonic() + policy.deadline
    delay = policy.initial
    attempt = 0
    while True:
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - classified just below
            if not retryable(error):
                raise
            attempt += 1
            wait = min(max(delay, _retry_after(error) or 0.0), policy.maximum)
            if time.monotonic() + wait > deadline:
                raise ApiUnavailable(
                    f"Kubernetes API call {what or getattr(fn, '__name__', fn)} failed {attempt} "
                    f"time{'s' if attempt != 1 else ''} within its {policy.deadline:g} s retry deadline, "
                    f"last with {describe(error)}; check the API server's health "
                    "(GKE control plane upgrades return 503 for minutes) and retry the step"
                ) from error
            if on_retry:
                on_retry(f"{what or getattr(fn, '__name__', 'API call')}: {describe(error)}; retry in {wait:.1f} s")
            sleep(wait)
            delay = min(delay * 2, policy.maximum)
