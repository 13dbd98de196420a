"""List, then watch from the list's resourceVersion; re-list when the watch answers 410 Gone.

The API server keeps a window of history; a watch from a resourceVersion
older than it fails with 410 Gone ("too old resource version"), and the
client must list again to get a current resourceVersion
(https://kubernetes.io/docs/reference/using-api/api-concepts/#efficient-detection-of-changes).
Each watch request carries ``timeoutSeconds``, so the stream also ends at
intervals and the caller gets a chance to look at the clock. 429, 5xx and
dropped connections back off (capped exponential) and resume from the last
resourceVersion seen.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, cast

from kubernetes import watch as k8s_watch
from kubernetes.client.exceptions import ApiException

from multislice.backends.gke import retry
from multislice.backends.gke.client import Kube

#: Event types yielded besides the API's ADDED / MODIFIED / DELETED.
LISTED, IDLE = "LISTED", "IDLE"


def follow(
    kube: Kube,
    list_fn: Callable[..., Any],
    *args: Any,
    what: str,
    deadline: float,
    on_relist: Callable[[str], None] | None = None,
    watch_seconds: float | None = None,
    listed_marker: bool = False,
    **kwargs: Any,
) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """Yield ``(type, object)`` for the objects ``list_fn`` lists, until ``deadline`` (``time.monotonic()``).

    First every listed object as ``LISTED``, then watch events (``ADDED``,
    ``MODIFIED``, ``DELETED``); ``(IDLE, None)`` whenever a watch request ends
    with nothing new. After 410 Gone it lists again (``LISTED`` again) and
    tells ``on_relist`` why. ``watch_seconds`` (default ``kube.timings.watch_seconds``) bounds each watch request,
    so an ``IDLE`` comes at least that often. With ``listed_marker``, each list's items are followed by
    ``(LISTED, None)``: the caller has seen the whole list (a waiter looks at the state once per list, not per item).

    The watch starts from the list's ``resourceVersion``, so no change between the list and the watch is missed.

    Raises:
        multislice.backends.gke.retry.ApiUnavailable: the API kept failing past ``kube.timings.api_deadline``.
        kubernetes.client.exceptions.ApiException: an error that is not retried (403, 404, ...).
    """
    resource_version: str | None = None
    delay, failing_since = kube.timings.backoff_initial, None
    while time.monotonic() < deadline:
        if resource_version is None:
            listed = kube.call(list_fn, *args, what=f"list {what}", **kwargs)
            if not isinstance(listed, dict):  # a typed list (core v1's V1PodList ...): as the API sent it
                listed = cast(dict[str, Any], kube.api.sanitize_for_serialization(listed))
            resource_version = listed.get("metadata", {}).get("resourceVersion") or "0"
            for item in listed.get("items", []):
                yield LISTED, item
            if listed_marker:
                yield LISTED, None
        timeout = max(1, int(min(watch_seconds or kube.timings.watch_seconds, deadline - time.monotonic())))
        stream = k8s_watch.Watch()
        try:
            for event in stream.stream(
                list_fn, *args, resource_version=resource_version, timeout_seconds=timeout,
                _request_timeout=timeout + 30, **kwargs,
            ):  # fmt: skip
                failing_since, delay = None, kube.timings.backoff_initial
                # Watch.stream yields dicts for a list function that deserialises (its annotation is loose).
                event = cast(dict[str, Any], event)
                obj: dict[str, Any] = event["raw_object"]
                resource_version = obj.get("metadata", {}).get("resourceVersion") or resource_version
                yield event["type"], obj
            yield IDLE, None
        except ApiException as error:
            if error.status == 410:
                if on_relist:
                    on_relist(f"watch of {what} expired (410 Gone: {error.reason}); listing again")
                resource_version = None
                continue
            if not retry.retryable(error):
                raise
            failing_since, delay = _back_off(kube, what, error, failing_since, delay)
        except retry.TRANSPORT_ERRORS as error:
            failing_since, delay = _back_off(kube, what, error, failing_since, delay)
        finally:
            stream.stop()


def _back_off(kube: Kube, what: str, error: BaseException, since: float | None, delay: float) -> tuple[float, float]:
    now = time.monotonic()
    since = since or now
    if now - since + delay > kube.timings.api_deadline:
        raise retry.ApiUnavailable(
            f"watch of {what} kept failing for {now - since:.0f} s, last with {retry.describe(error)}; "
            "check the API server's health and retry the step"
        ) from error
    if kube.say:
        kube.say(f"watch {what}: {retry.describe(error)}; retry in {delay:.1f} s")
    time.sleep(delay)
    return since, min(delay * 2, kube.timings.backoff_max)
