"""KFP components: one module per pipeline step, each a thin wrapper over ``multislice.steps``.

Every component is a lightweight Python component whose body imports
``multislice`` and calls the step; the work happens in the package, which the
base image must carry. Which base image, explicitly:

* ``multislice compile`` takes ``--base-image``; without it, the pipeline image
  that ``multislice images build --cloud-build`` or ``make images PUSH=1`` pushed
  (``build/images/pipeline.json``, by digest); without that, the profile's
  ``images.pipeline``; without that, :data:`DEFAULT_BASE_IMAGE`.
* Any of these must be built from ``containers/pipeline/Dockerfile`` (or carry the
  same): ``pyproject.toml``'s ``pipeline`` extra at ``requirements/pipeline.txt``'s
  pins, kfp 2.17.0 included, and this package. The components are compiled with
  ``install_kfp_package=False, packages_to_install=[]``: nothing is pip-installed at
  run time, because a run-time ``pip install`` would need network access from the
  cluster's pods and could resolve other versions than the ones tested; a plain
  ``python:3.12`` base image therefore does not work, by design.
* The plan step checks that the image is the release the YAML was compiled by
  (:mod:`multislice.release`), so a mismatch fails first, with one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from kfp import dsl
from kfp.dsl.python_component import PythonComponent

#: The pipeline image the components run in when nothing else names one (a local tag: push your own
#: with ``multislice images build --cloud-build`` for a cluster to pull).
DEFAULT_BASE_IMAGE = "multislice-pipeline:0.1.0"


def make(func: Callable, base_image: str) -> PythonComponent:
    """A KFP component of ``func`` running in ``base_image`` (the pipeline image), installing nothing at run time."""
    component = dsl.component(func, base_image=base_image, install_kfp_package=False, packages_to_install=[])
    # dsl.component is unannotated: given ``func`` it returns the component, without it a decorator (partial).
    return cast(PythonComponent, component)
