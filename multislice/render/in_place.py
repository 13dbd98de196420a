"""In-place restart of a TPU JobSet (JobSet v0.12.0, KEP-467): what the manifest needs and which strategy a run gets.

With ``spec.failurePolicy.restartStrategy: InPlaceRestart`` a host failure restarts the containers of every pod where
it is (same pod, same name, same node: no reschedule, no image pull) instead of recreating every pod. What
kubernetes-sigs/jobset v0.12.0 requires, read in its source:

- the webhook (``pkg/webhooks/jobset_webhook.go``, ``ValidateCreate``) refuses ``InPlaceRestart`` unless the
  controller runs with ``--feature-gates=InPlaceRestart=true`` (``pkg/features/features.go``: alpha, default off), and
  with it requires every replicated Job's template to have ``backoffLimit`` 2147483647 (MaxInt32),
  ``podReplacementPolicy: Failed`` and ``completions`` == ``parallelism``;
- the controller (``pkg/controllers/in_place_restart.go``, ``reconcileInPlaceRestart``) reads each pod's annotation
  :data:`ATTEMPT_ANNOTATION`, which nobody but the agent writes; when the pods disagree it sets
  ``status.previousInPlaceRestartAttempt`` to the highest minus one, when they all agree
  ``status.currentInPlaceRestartAttempt`` to it, and it fails the JobSet when a container's ``restartCount`` or the
  highest attempt (less the restarts that do not count) exceeds ``maxRestarts``;
- the agent (``cmd/in-place-restart-agent/main.go``), an init container with ``restartPolicy: Always`` (sidecar
  mode: no ``WORKER_COMMAND``): at start it patches the pod's attempt annotation (0 on a new JobSet, else
  ``currentInPlaceRestartAttempt`` + 1), exits 1 (``IN_PLACE_RESTART_EXIT_CODE``) when its attempt is at or below
  ``previousInPlaceRestartAttempt``, and opens its startup probe (``/barrier-is-down`` on 8081) when its attempt equals
  ``currentInPlaceRestartAttempt``: the trainer container starts only after every pod reached the same attempt. It
  reads its namespace from the mounted service-account token directory and watches the JobSet by name, so the pod's
  ServiceAccount may ``patch`` pods and ``get, list, watch`` JobSets (``site/static/examples/in-place-restart/
  service-account.yaml``, also the ValidatingAdmissionPolicy that limits that account's pod updates to the
  annotation: :func:`admission_policy`);
- the kubelet restarts all containers of a pod in place when a container exits with a code a ``restartPolicyRules``
  rule with action ``RestartAllContainers`` matches (Kubernetes 1.35, alpha gates ``ContainerRestartRules`` and
  ``RestartAllContainersOnContainerExits`` on the API server and the kubelets; KEP-5307 and KEP-5532,
  kubernetes/enhancements ``keps/sig-node/5532-restart-pod-on-container-exits``).

Fatal errors still fail the JobSet: the trainer's rule restarts in place only on this project's restartable exit codes
(:data:`multislice.render.jobset.RESTARTABLE_EXIT_CODES`: 42 and killed by a signal), so any other non-zero exit
matches no rule, the container stays terminated (``restartPolicy: Never``), the pod fails, the Job's
``podFailurePolicy`` fails it (reason ``PodFailurePolicy``) and the JobSet's ``FailJobSet`` rule fails the JobSet, as
KEP-467's story 2 ("Combining In-Place Restart With The Failure API") does. A pod lost with its node is replaced by
the Job controller (``podReplacementPolicy: Failed``, the backoff limit never reached) and its agent's new attempt
makes the others restart in place.

The agent gets the pod's API token by a projected volume mounted in its container only (what the ServiceAccount
admission plugin's automount would mount in every container: the token, the cluster's CA from ConfigMap
``kube-root-ca.crt``, the namespace), so the trainer container keeps no API credentials, as without in-place restart.
The agent requests no CPU or memory: Kueue counts a sidecar's requests in the pod set (``pod_requests`` in
:mod:`multislice.render.kueue`, as kubernetes ``component-helpers/resource`` ``PodRequests``), and a request would need
cpu and memory quota in a ClusterQueue that covers TPU chips only; it has no limits either (an OOM kill of the agent
would itself restart the pod in place).
"""

from __future__ import annotations

from typing import Any, Literal

from multislice import names
from multislice.plan import Plan

#: The JobSet restart strategies this project renders (``spec.failurePolicy.restartStrategy``).
Strategy = Literal["InPlaceRestart", "Recreate"]
IN_PLACE: Strategy = "InPlaceRestart"
RECREATE: Strategy = "Recreate"

#: The pod annotation the agent writes and the controller reads (``api/jobset/v1alpha2/jobset_types.go``,
#: ``InPlaceRestartAttemptKey``).
ATTEMPT_ANNOTATION = "jobset.sigs.k8s.io/in-place-restart-attempt"
#: The init (sidecar) container running the agent, named as the upstream example names it.
AGENT_CONTAINER = "in-place-restart-agent"
#: The agent's startup probe: its defaults (``DefaultStartupProbePath``, ``DefaultStartupProbePort``).
BARRIER_PATH, BARRIER_PORT = "/barrier-is-down", 8081
#: How long the trainer may wait at the barrier for the other pods: the example's 600 probes, one a second.
BARRIER_PROBES = 600
#: ``backoffLimit`` the webhook requires under InPlaceRestart (MaxInt32).
BACKOFF_LIMIT = 2147483647
#: Where the kubelet and client-go's in-cluster config look for the ServiceAccount's token, CA and namespace.
TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_VOLUME = "in-place-restart-agent-token"
#: Kubernetes' bound token lifetime for automounted tokens (``kube-api-access-*``), seconds.
TOKEN_SECONDS = 3607
#: The JobSet webhook's refusal when the controller's InPlaceRestart gate is off (``jobset_webhook.go``).
GATE_OFF_MESSAGE = "InPlaceRestart restart strategy cannot be set when InPlaceRestart feature gate is disabled"


def requested(plan: Plan, hardware: str) -> Strategy:
    """The strategy a TPU JobSet is rendered with before provision has looked at the cluster: ``InPlaceRestart``
    unless ``restart_strategy: recreate`` (``multislice render``'s dry run shows it; provision falls back to
    Recreate on a cluster without the gates, :mod:`multislice.backends.gke.in_place`). CPU JobSets (the local backend's
    and CPU nodes') stay ``Recreate``, what ``auto`` gives on a cluster without the gates; the local supervisor also
    restarts a JobSet rendered ``InPlaceRestart`` in place (:mod:`multislice.backends.local.supervisor`)."""
    if hardware != "tpu" or plan.spec.restart_strategy == "recreate":
        return RECREATE
    return IN_PLACE


def restart_rules(codes: tuple[int, ...] | None) -> list[dict[str, Any]]:
    """``restartPolicyRules``: restart every container of the pod in place on an exit code in ``codes``, or, with
    None, on any non-zero exit (the agent's)."""
    exit_codes = {"operator": "NotIn", "values": [0]} if codes is None else {"operator": "In", "values": list(codes)}
    return [{"action": "RestartAllContainers", "exitCodes": exit_codes}]


def agent_container(plan: Plan) -> dict[str, Any]:
    """The agent as a sidecar (init container, ``restartPolicy: Always``), as the upstream example
    ``site/static/examples/in-place-restart/jobset-sidecar-container-mode.yaml`` renders it, with its token mounted."""
    return {
        "name": AGENT_CONTAINER,
        "image": plan.spec.images.in_place_restart_agent,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        "restartPolicyRules": restart_rules(None),
        "startupProbe": {
            "httpGet": {"path": BARRIER_PATH, "port": BARRIER_PORT},
            "failureThreshold": BARRIER_PROBES,
            "periodSeconds": 1,
        },
        "env": [
            {
                "name": "JOBSET_NAME",
                "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{names.JOBSET_NAME_KEY}']"}},
            },
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],  # fmt: skip
        "volumeMounts": [{"name": TOKEN_VOLUME, "mountPath": TOKEN_DIR, "readOnly": True}],
    }


def token_volume() -> dict[str, Any]:
    """The agent's API credentials: what ``automountServiceAccountToken`` mounts (kubernetes
    ``plugin/pkg/admission/serviceaccount/admission.go``, ``TokenVolumeSource``), as a volume of its own."""
    return {
        "name": TOKEN_VOLUME,
        "projected": {
            "defaultMode": 0o644,
            "sources": [
                {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_SECONDS}},
                {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
                {
                    "downwardAPI": {
                        "items": [
                            {"path": "namespace", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}
                        ]
                    }
                },
            ],  # fmt: skip
        },
    }


def apply(plan: Plan, job_spec: dict[str, Any], pod_spec: dict[str, Any], trainer: dict[str, Any],
          restartable: tuple[int, ...], *, agent: bool) -> None:  # fmt: skip
    """Make a replicated Job's template in-place restartable (module docstring), in place: the webhook's
    ``backoffLimit`` and ``podReplacementPolicy``, the trainer's rules on ``restartable`` exit codes and, with
    ``agent``, the agent sidecar and its token volume."""
    job_spec["backoffLimit"] = BACKOFF_LIMIT
    job_spec["podReplacementPolicy"] = "Failed"
    trainer["restartPolicy"] = "Never"
    trainer["restartPolicyRules"] = restart_rules(restartable)
    if agent:
        pod_spec["initContainers"] = [agent_container(plan)]
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), token_volume()]


def agent_rules() -> list[dict[str, Any]]:
    """What the agent asks of the API as the pod's ServiceAccount (the upstream ``service-account.yaml`` Role)."""
    return [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]},
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["get", "list", "watch"]},
    ]


def admission_policy(namespace: str, account: str, name: str) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy and its binding (``admissionregistration.k8s.io/v1``) that let ServiceAccount
    ``account`` of ``namespace`` change nothing of a pod but the :data:`ATTEMPT_ANNOTATION` (the upstream
    ``service-account.yaml``'s policy, for this account only; its ``oldSpec``/``newSpec`` aliases put right)."""
    user = f"system:serviceaccount:{namespace}:{account}"
    same_but_attempt = (
        f"variables.oldAnnotations.all(key, key == '{ATTEMPT_ANNOTATION}' || (key in variables.newAnnotations && "
        "variables.oldAnnotations[key] == variables.newAnnotations[key])) && "
        f"variables.newAnnotations.all(key, key == '{ATTEMPT_ANNOTATION}' || (key in variables.oldAnnotations && "
        "variables.oldAnnotations[key] == variables.newAnnotations[key]))"
    )
    labels = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}]},
            "matchConditions": [{"name": "is-in-place-restart-agent",
                                 "expression": f"request.userInfo.username == '{user}'"}],
            "variables": [
                {"name": "oldSpec", "expression": "oldObject.spec"},
                {"name": "newSpec", "expression": "object.spec"},
                {"name": "oldLabels", "expression": "has(oldObject.metadata.labels) ? oldObject.metadata.labels : {}"},
                {"name": "newLabels", "expression": "has(object.metadata.labels) ? object.metadata.labels : {}"},
                {"name": "oldAnnotations",
                 "expression": "has(oldObject.metadata.annotations) ? oldObject.metadata.annotations : {}"},
                {"name": "newAnnotations",
                 "expression": "has(object.metadata.annotations) ? object.metadata.annotations : {}"},
            ],
            "validations": [{
                "expression": "variables.oldSpec == variables.newSpec && variables.oldLabels == variables.newLabels "
                              f"&& {same_but_attempt}",
                "message": f"ServiceAccount {account} may only change the pod annotation {ATTEMPT_ANNOTATION} "
                           "(JobSet's in-place restart agent)",
            }],
        },
    }  # fmt: skip
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name, "labels": labels},
        "spec": {"policyName": name, "validationActions": ["Deny"]},
    }
    return [policy, binding]
