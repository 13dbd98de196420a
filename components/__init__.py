"""KFP components: one module per pipeline step, each a thin wrapper over ``multislice.steps``.

Every component is a lightweight Python component whose body imports
``multislice`` and calls the step; the work happens in the package, which the
pipeline image carries. Components are built for a base image chosen when the
pipeline is built (:func:`make`), with ``install_kfp_package=False``: the
image already has the pinned kfp, and nothing is pip-installed at run time.
"""

from __future__ import annotations

from collections.abc import Callable

from kfp import dsl

#: The pipeline image the components run in unless the profile names another.
DEFAULT_BASE_IMAGE = "multislice-pipeline:0.1.0"


def make(func: Callable, base_image: str) -> dsl.component_factory.PythonComponent:
    """A KFP component of ``func`` running in ``base_image``, installing nothing at run time."""
    return dsl.component(func, base_image=base_image, install_kfp_package=False, packages_to_install=[])
