"""Following the leader pod's log (slice 0, host 0) across JobSet restarts.

A background thread reads ``GET /api/v1/namespaces/NS/pods/POD/log?follow=true``
for the trainer container of the newest restart attempt's leader. When the
stream ends (the pod finished, the connection dropped, the JobSet restarted
and recreated its pods) it looks for the leader again and re-attaches.

Lines are tracked by time, not by count: the log is read with
``timestamps=true`` (each line prefixed by the kubelet's RFC 3339 nanosecond
timestamp) and a re-attach asks for ``sinceTime`` = the last line's second
(core v1 ``PodLogOptions``; the official client's ``read_namespaced_pod_log``
has no ``since_time``, so the call is made with ``ApiClient.call_api``).
Lines older than the last one passed on, or equal to it and already passed
on, are skipped. After kubelet log rotation the log the API serves starts
later than what was read, so skipping by count would drop new lines; by time
nothing is lost that the kubelet still has, and nothing is repeated.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines
from urllib3 import HTTPResponse

from multislice import names
from multislice.backends.gke import pods as pod_state
from multislice.backends.gke import retry
from multislice.backends.gke.client import Kube

#: A followed log silent this long is re-attached (a dead connection would otherwise hang the reader), seconds.
READ_TIMEOUT_SECONDS = 600


def _sortable(stamp: str) -> str:
    """An RFC 3339 timestamp with its fraction padded to 9 digits (RFC3339Nano trims trailing zeros)."""
    head, _, frac = stamp.rstrip("Z").partition(".")
    return f"{head}.{frac:0<9}Z"


class LeaderLog(threading.Thread):
    """Calls ``on_line(pod_name, line)`` for each new line of the JobSet's leader pod, in order.

    Args:
        kube: The API client.
        jobset: JobSet name.
        on_line: Called from this thread (under a lock) for each complete new line.
        poll_seconds: Wait between looks for a leader pod that is not running yet.
        find_pod: Finds the pod to follow instead of the JobSet's leader (a RayJob's submitter pod), or None.
        container: The container whose log is read.
    """

    def __init__(
        self,
        kube: Kube,
        jobset: str,
        on_line: Callable[[str, str], None],
        poll_seconds: float,
        find_pod: Callable[[], Any] | None = None,
        container: str = names.TRAINER_CONTAINER,
    ):
        super().__init__(name=f"leader-log-{jobset}", daemon=True)
        self.kube, self.jobset, self.on_line, self.poll = kube, jobset, on_line, poll_seconds
        self.find_pod = find_pod or (lambda: pod_state.leader(pod_state.list_pods(self.kube, self.jobset)))
        self.container = container
        self.read: dict[str, tuple[str, set[str]]] = {}  # pod -> (last timestamp passed on, lines passed at it)
        self.pods_followed: list[str] = []
        self._lock = threading.Lock()
        self._stop_event = threading.Event()

    def stop(self) -> None:
        """Ask the thread to end after its current read."""
        self._stop_event.set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                pod = self.find_pod()
                if pod is not None and pod.status.phase in ("Running", "Succeeded", "Failed"):
                    self._read(pod.metadata.name, follow=pod.status.phase == "Running")
            except (ApiException, retry.ApiUnavailable, *retry.TRANSPORT_ERRORS):
                pass  # the pod went away or the API hiccuped: look for the leader again
            self._stop_event.wait(self.poll)

    def catch_up(self) -> None:
        """Read what is left of the current leader's log without following (call after :meth:`stop`)."""
        try:
            pod = self.find_pod()
            if pod is not None:
                self._read(pod.metadata.name, follow=False)
        except (ApiException, retry.ApiUnavailable, *retry.TRANSPORT_ERRORS):
            pass

    def _read(self, pod_name: str, follow: bool) -> None:
        query = [("container", self.container), ("timestamps", "true"), ("follow", str(follow).lower())]
        last = self.read.get(pod_name)
        if last is not None:
            query.append(("sinceTime", last[0][:19] + "Z"))  # metav1.Time has whole seconds
        # _preload_content=False: the client returns urllib3's unread response (its annotation lists every
        # deserialised type).
        response = cast(HTTPResponse, self.kube.api.call_api(
            f"/api/v1/namespaces/{self.kube.namespace}/pods/{pod_name}/log", "GET", query_params=query,
            header_params={"Accept": "*/*"}, auth_settings=["BearerToken"], _preload_content=False,
            _request_timeout=(10, READ_TIMEOUT_SECONDS), _return_http_data_only=True,
        ))  # fmt: skip
        if pod_name not in self.pods_followed:
            self.pods_followed.append(pod_name)
        try:
            for stamped in iter_resp_lines(response):
                stamp, _, line = stamped.partition(" ")
                stamp = _sortable(stamp)
                with self._lock:
                    last_stamp, at_last = self.read.get(pod_name, ("", set()))
                    if stamp < last_stamp or (stamp == last_stamp and line in at_last):
                        continue
                    self.read[pod_name] = (stamp, (at_last if stamp == last_stamp else set()) | {line})
                    self.on_line(pod_name, line)
                if self._stop_event.is_set() and follow:
                    break
        finally:
            response.close()
            response.release_conn()


def tail(kube: Kube, pod_name: str, lines: int, container: str = names.TRAINER_CONTAINER) -> str:
    """The last ``lines`` lines of a pod's ``container`` log (the trainer's by default; '' when unreadable)."""
    try:
        return kube.call(
            kube.core.read_namespaced_pod_log, pod_name, kube.namespace, container=container,
            tail_lines=lines, what=f"read log of pod {pod_name}",
        )  # fmt: skip
    except (ApiException, retry.ApiUnavailable):
        return ""
