"""The Kubernetes API as the GKE steps use it: one ApiClient, the run's namespace, and retries.

Every call goes through :meth:`Kube.call`, which retries 429, 5xx and
connection resets (:mod:`.retry`). API groups and versions used: JobSet
``jobset.x-k8s.io/v1alpha2``, Kueue ``kueue.x-k8s.io/v1beta2`` (Kueue v0.19
serves it), core v1 and batch v1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes import client as k8s

from multislice.backends.gke import retry
from multislice.timings import DEFAULTS, Timings

JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
WORKLOAD_PLURAL = "workloads"
#: The field manager of every server-side apply (``kubectl apply --server-side --field-manager``).
FIELD_MANAGER = "multislice-pipelines"


class Kube:
    """A Kubernetes API client bound to the run's namespace, with retries.

    Args:
        api: A configured ``kubernetes.client.ApiClient`` (see :mod:`.access`).
        namespace: Namespace of the run's JobSets, Jobs and pods.
        timings: Retry backoff and deadline (and the steps' waits).
        say: Where retry notices go (one line each).
    """

    def __init__(
        self,
        api: k8s.ApiClient,
        namespace: str,
        timings: Timings = DEFAULTS["gke"],
        say: Callable[[str], None] | None = None,
    ):
        self.api = api
        self.namespace = namespace
        self.timings = timings
        self.say = say
        self.core = k8s.CoreV1Api(api)
        self.batch = k8s.BatchV1Api(api)
        self.custom = k8s.CustomObjectsApi(api)
        self.crds = k8s.ApiextensionsV1Api(api)
        self.policy = retry.RetryPolicy(timings.backoff_initial, timings.backoff_max, timings.api_deadline)

    def call(self, fn: Callable[..., Any], *args: Any, what: str = "", **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` with retries (:func:`.retry.call`)."""
        return retry.call(self.policy, fn, *args, what=what, on_retry=self.say, **kwargs)

    # JobSets and Workloads are custom objects of the run's namespace.

    def get_jobset(self, name: str) -> dict[str, Any] | None:
        """The JobSet ``name``, or None when it does not exist."""
        return self._get(JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL, name)

    def list_jobsets(self, label_selector: str) -> list[dict[str, Any]]:
        """JobSets of the namespace matching a label selector (``k=v,k2=v2``)."""
        found = self.call(
            self.custom.list_namespaced_custom_object, JOBSET_GROUP, JOBSET_VERSION, self.namespace,
            JOBSET_PLURAL, label_selector=label_selector, what="list JobSets",
        )  # fmt: skip
        return found.get("items", [])

    def list_workloads(self) -> list[dict[str, Any]]:
        """Kueue Workloads of the namespace."""
        found = self.call(
            self.custom.list_namespaced_custom_object, KUEUE_GROUP, KUEUE_VERSION, self.namespace,
            WORKLOAD_PLURAL, what="list Kueue Workloads",
        )  # fmt: skip
        return found.get("items", [])

    def _get(self, group: str, version: str, plural: str, name: str) -> dict[str, Any] | None:
        try:
            return self.call(
                self.custom.get_namespaced_custom_object, group, version, self.namespace, plural, name,
                what=f"get {plural} {name}",
            )  # fmt: skip
        except k8s.ApiException as error:
            if error.status == 404:
                return None
            raise
