"""Compile targets: where the compiled pipeline YAML is uploaded, and what it may carry for that place.

* ``kfp``: Kubeflow Pipelines on a Kubernetes cluster. The YAML may carry a
  second document, the kfp-kubernetes platform config
  (``platforms.kubernetes.deploymentSpec.executors``): node selectors of the
  component pods and their timeouts (pod ``activeDeadlineSeconds``), which
  come from the same waits the steps use (:func:`multislice.timings.step_deadline`).
  Source: kfp-kubernetes 2.17 ``add_node_selector``, ``set_timeout``. The run's
  Kubernetes service account is given when the run is created
  (:mod:`multislice.submit`), not in the YAML.
* ``vertex``: Vertex AI Pipelines. One YAML document, the PipelineSpec only:
  ``aiplatform.PipelineJob`` reads the template with ``yaml.safe_load`` and
  refuses a multi-document file, and Vertex runs no Kubernetes platform config.
  Service account, network and pipeline root are given at submission.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from multislice import exporting, timings
from multislice.config import ConfigError, hub
from multislice.delivery.notify import WEBHOOK_ENV

if TYPE_CHECKING:
    from multislice.config import RunSpec

TARGETS = ("kfp", "vertex")


@dataclass(frozen=True)
class KubernetesConfig:
    """kfp-kubernetes platform config of the ``kfp`` target, applied to every task of the pipeline.

    Attributes:
        node_selector: Node labels the component pods must match (e.g.
            ``{"cloud.google.com/gke-nodepool": "pipelines-cpu"}``, to keep them
            off TPU nodes); empty for none.
        timeouts: Seconds, per step name (:data:`multislice.timings.STEPS`), after
            which Kubernetes stops the component pod; a step not named gets
            :func:`multislice.timings.step_deadline` of the run spec: its longest
            wait plus a margin, so a pod is never stopped while its step still
            waits for something that would end in an actionable message.
        webhook_secret: Kubernetes Secret (key ``url``) with the exit handler's webhook URL
            (:meth:`mount_webhook_secret`); create it with
            ``kubectl create secret generic multislice-notify-webhook --from-literal=url=https://...``.
    """

    node_selector: Mapping[str, str] = field(default_factory=dict)
    timeouts: Mapping[str, int] = field(default_factory=dict)
    webhook_secret: str = "multislice-notify-webhook"

    def mount_webhook_secret(self, task: Any) -> None:
        """Put the webhook URL into the exit handler's environment from a Kubernetes Secret, by reference.

        kfp-kubernetes ``use_secret_as_env`` (``optional``: a cluster without the
        Secret runs the exit handler without a notification): key ``url`` of
        Secret ``webhook_secret`` in the run's namespace becomes
        ``$MULTISLICE_NOTIFY_WEBHOOK_URL`` (:data:`multislice.delivery.notify.WEBHOOK_ENV`).
        The compiled YAML names the Secret, never its value.
        """
        from kfp import kubernetes

        kubernetes.use_secret_as_env(
            task, secret_name=self.webhook_secret, secret_key_to_env={"url": WEBHOOK_ENV}, optional=True
        )

    def mount_hub_tokens(self, task: Any, spec: RunSpec) -> list[str]:
        """Give a plan task the Hugging Face token of each stage whose data names a Kubernetes Secret, as the
        stage's training pods get it (:func:`multislice.render.jobset.data_token_env`: key ``token``, by reference).

        kfp-kubernetes ``use_secret_as_env`` per distinct ``data.hf_token_kubernetes_secret``, into
        :func:`multislice.config.hub.plan_token_env` of its name (one variable per Secret: stages may use different
        tokens; the plan step lists each stage's ``hf://`` globs with its own,
        :func:`multislice.steps.plan.stage_hub_tokens`). ``optional``: KFP's pods run in
        ``service_accounts.pipeline_namespace``, which may not hold the Secret (the trainer pods read it in
        ``namespace``); without it the plan lists with no token and a private dataset is refused there, naming
        the token. The compiled YAML names the Secrets, never a token. Returns the Secrets mounted.
        """
        from kfp import kubernetes

        secrets = sorted({s for stage in spec.stages if (s := getattr(stage.data, "hf_token_kubernetes_secret", ""))})
        for secret in secrets:
            kubernetes.use_secret_as_env(
                task, secret_name=secret, secret_key_to_env={"token": hub.plan_token_env(secret)}, optional=True
            )
        return secrets

    def deadlines(self, spec: RunSpec) -> dict[str, int]:
        """Every step's pod deadline for a run spec, seconds: ``timeouts`` where given, else the spec's; the export
        step's grows by its largest export's own time from the model's size (:func:`export_seconds`)."""
        found = {step: int(self.timeouts.get(step, timings.step_deadline(spec, step))) for step in timings.STEPS}
        if "export" not in self.timeouts:
            found["export"] += math.ceil(export_seconds(spec))
        return found

    def apply(self, task: Any, step: str, spec: RunSpec) -> None:
        """Set the node selector and the step's deadline on a pipeline task (a ``kfp.dsl.PipelineTask``)."""
        from kfp import kubernetes

        for key, value in sorted(self.node_selector.items()):
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        kubernetes.set_timeout(task, self.deadlines(spec)[step])


def export_seconds(spec: RunSpec) -> float:
    """The longest export's own run time of the spec's stages, seconds (:func:`multislice.exporting.sizing`; the
    training's weight sharding unknown here, so a stacked weight's whole chunk counted); 0 without an export or
    when a model's size is unknown (plan refuses that export)."""
    longest = 0.0
    for stage in spec.stages:
        if not stage.export:
            continue
        try:
            longest = max(longest, exporting.sizing(stage, exporting.default_dtype(stage)).seconds)
        except ValueError:  # the model's size is unknown: plan refuses its export
            continue
    return longest


def check_target(target: str) -> str:
    """Return ``target`` if known.

    Raises:
        multislice.config.ConfigError: an unknown target, naming the known ones.
    """
    if target not in TARGETS:
        raise ConfigError([("target", f"unknown compile target {target!r}; use one of {', '.join(TARGETS)}")])
    return target


def documents(path: str | Path) -> list[dict[str, Any]]:
    """The YAML documents of a compiled pipeline file, in order (1 for ``vertex``, 1 or 2 for ``kfp``)."""
    with open(path, encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]
