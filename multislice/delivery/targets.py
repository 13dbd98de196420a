"""Compile targets: where the compiled pipeline YAML is uploaded, and what it may carry for that place.

* ``kfp``: Kubeflow Pipelines on a Kubernetes cluster. The YAML may carry a
  second document, the kfp-kubernetes platform config
  (``platforms.kubernetes.deploymentSpec.executors``): node selectors of the
  component pods and their timeouts (pod ``activeDeadlineSeconds``). Source:
  kfp-kubernetes 2.17 ``add_node_selector``, ``set_timeout``. The run's
  Kubernetes service account is given when the run is created
  (:mod:`multislice.submit`), not in the YAML.
* ``vertex``: Vertex AI Pipelines. One YAML document, the PipelineSpec only:
  ``aiplatform.PipelineJob`` reads the template with ``yaml.safe_load`` and
  refuses a multi-document file, and Vertex runs no Kubernetes platform config.
  Service account, network and pipeline root are given at submission.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

TARGETS = ("kfp", "vertex")


def _default_timeouts() -> dict[str, int]:
    from multislice.steps import launch, train, verify_checkpoint

    return {
        "plan": 600,
        "provision": 3600,  # GKE creates TPU node pools in minutes to tens of minutes
        "launch": launch.STARTUP_TIMEOUT_SECONDS + 300,
        "train": int(train.TRAIN_TIMEOUT_SECONDS) + 600,
        "verify_checkpoint": verify_checkpoint.VERIFY_TIMEOUT_SECONDS + 300,
        "cleanup": 900,
    }


@dataclass(frozen=True)
class KubernetesConfig:
    """kfp-kubernetes platform config of the ``kfp`` target, applied to every task of the pipeline.

    Attributes:
        node_selector: Node labels the component pods must match (e.g.
            ``{"cloud.google.com/gke-nodepool": "pipelines-cpu"}``, to keep them
            off TPU nodes); empty for none.
        timeouts: Seconds, per step name (``plan``, ``provision``, ``admit``,
            ``launch``, ``train``, ``verify_checkpoint``, ``cleanup``), after
            which Kubernetes stops the component pod. A step not named has no
            timeout: by default ``admit`` (a Workload may wait in its queue for
            capacity as long as the queue allows) and ``preflight`` (it may
            AOT-compile several candidate configs, each up to
            ``multislice.preflight.COMPILE_TIMEOUT_SECONDS``). The defaults are
            each step's own wait limit plus a margin.
    """

    node_selector: Mapping[str, str] = field(default_factory=dict)
    timeouts: Mapping[str, int] = field(default_factory=_default_timeouts)

    def apply(self, task: Any, step: str) -> None:
        """Set the node selector and the step's timeout on a pipeline task (a ``kfp.dsl.PipelineTask``)."""
        from kfp import kubernetes

        for key, value in sorted(self.node_selector.items()):
            kubernetes.add_node_selector(task, label_key=key, label_value=value)
        if step in self.timeouts:
            kubernetes.set_timeout(task, int(self.timeouts[step]))


def check_target(target: str) -> str:
    """Return ``target`` if known.

    Raises:
        multislice.config.ConfigError: an unknown target, naming the known ones.
    """
    from multislice.config import ConfigError

    if target not in TARGETS:
        raise ConfigError([("target", f"unknown compile target {target!r}; use one of {', '.join(TARGETS)}")])
    return target


def documents(path: str | Path) -> list[dict[str, Any]]:
    """The YAML documents of a compiled pipeline file, in order (1 for ``vertex``, 1 or 2 for ``kfp``)."""
    with open(path, encoding="utf-8") as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]
