"""Start a training process with only the modules its step loop uses.

MaxText 0.2.5's ``maxtext.trainers.pre_train.train`` imports, at its top level,
much that a pre-training step loop never runs (measured with
``python -X importtime``: ``benchmarks/train_startup.py``, figures in
docs/reliability.md):

- ``torch``: ``tensorboardX.writer`` tries ``import torch`` only to accept torch
  tensors beside NumPy arrays, and goes on without it (``except ImportError``);
  reached through ``maxtext.common.gcloud_stub`` -> ``tensorboardX``.
- ``transformers``: ``maxtext.input_pipeline.tokenizer`` and ``maxtext.models.deepseek``
  use it only to load a Hugging Face tokenizer (``transformers.AutoTokenizer``),
  ``maxtext.checkpoint_conversion.utils.load_dynamic`` (a ``.safetensors``
  ``load_parameters_path``) and ``maxtext.integration.tunix.tunix_adapter`` (RL)
  import ``hf_model_configs``, which builds Hugging Face configs at import.
- ``ml_goodput_measurement``: MaxText's goodput recorder (``maxtext.common.goodput``),
  used only when ``enable_goodput_recording`` or ``monitor_goodput`` is on; MaxText
  replaces it by its own no-op stubs when it cannot be imported
  (``maxtext.common.gcloud_stub.goodput_modules``, ``stub_on_error_when_not_decoupled``).
- ``cloud_accelerator_diagnostics`` (and through it ``google.cloud.aiplatform``, the
  Vertex AI SDK): ``maxtext.common.vertex_tensorboard``'s uploader, used only with
  ``use_vertex_tensorboard`` (or ``UPLOAD_DATA_TO_TENSORBOARD`` in the environment:
  ``train.py``, ``train_loop``); MaxText replaces it by a no-op stub when it cannot be
  imported (``gcloud_stub.vertex_tensorboard_modules``, ``stub_on_error_when_not_decoupled``).
  About 40% of the trainer's import time (``python -X importtime``, 7.5 s of 18.1 s
  at load average 10 on this machine).

:func:`install` changes no file of MaxText's. It works through the import
system's hooks (`sys.meta_path`, `sys.modules`,
https://docs.python.org/3/reference/import.html):

- *refused while importing*: ``torch`` while ``tensorboardX`` loads, and
  ``ml_goodput_measurement`` while ``maxtext.common.goodput`` loads unless the run
  records goodput: each importer falls back as written; the refusal ends there.
  ``cloud_accelerator_diagnostics`` is refused for the whole process unless the run
  uploads to Vertex AI TensorBoard (:func:`uploads_to_vertex_tensorboard`): MaxText's
  trainer asks for it at its import (``vertex_tensorboard_modules()``), not in a module
  this could import first.
- *deferred*: ``transformers`` is a stand-in module that imports the real one on
  first use of any attribute (``importlib.util.LazyLoader`` cannot: Python 3.12's
  ``_find_and_load`` reads ``__spec__`` at every later ``import transformers``,
  which runs the module).
- *on call*: ``load_dynamic`` and ``tunix_adapter`` are stand-ins whose attributes
  are functions that import the real module when called (their importers take
  names from them at import time and call them only on those paths).

A run that uses one of them (a Hugging Face tokenizer, a safetensors checkpoint)
still gets it, when it is used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

HEAVY = ("torch", "transformers", "ml_goodput_measurement", "tokamax", "cloud_accelerator_diagnostics")
"""Top-level packages whose import time :mod:`benchmarks.train_startup` reports."""

DEFERRED = ("transformers",)
"""Packages imported on first use of an attribute instead of at ``import``."""

ON_CALL = ("maxtext.checkpoint_conversion.utils.load_dynamic", "maxtext.integration.tunix.tunix_adapter")
"""Modules replaced by a stand-in whose functions import the real module when called."""

GOODPUT_KEYS = ("enable_goodput_recording", "monitor_goodput")
"""MaxText keys (``configs/base.yml``, both ``false`` there) that need ``ml_goodput_measurement``."""

VERTEX_TENSORBOARD = "cloud_accelerator_diagnostics"
"""The Vertex AI TensorBoard uploader's package (``maxtext.common.vertex_tensorboard``)."""


class _Refuser(importlib.abc.MetaPathFinder):
    """Makes ``import`` of the named packages (and their submodules) raise ``ModuleNotFoundError``."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if any(fullname == n or fullname.startswith(n + ".") for n in self.names):
            raise ModuleNotFoundError(
                f"{fullname} is not imported here (multislice.trainer.lean_imports)", name=fullname
            )
        return None


@contextmanager
def refusing(names: Sequence[str]) -> Iterator[None]:
    """Within the block, importing ``names`` fails as if they were not installed."""
    refuser = _Refuser(names)
    sys.meta_path.insert(0, refuser)
    try:
        yield
    finally:
        sys.meta_path.remove(refuser)


def _import_refusing(module: str, refused: Sequence[str]) -> None:
    if module in sys.modules or any(r in sys.modules for r in refused):
        return
    with refusing(refused):
        importlib.import_module(module)


class _DeferredModule(types.ModuleType):
    """Stand-in in ``sys.modules`` that imports the real module on first use of an attribute."""

    def __init__(self, name: str, spec: importlib.machinery.ModuleSpec | None) -> None:
        super().__init__(name)
        self.__spec__ = spec  # what the import system reads on a later ``import name``: no load

    def __getattr__(self, attribute: str) -> Any:
        return getattr(_real(self), attribute)


def _real(stand_in: types.ModuleType) -> types.ModuleType:
    name = stand_in.__name__
    if sys.modules.get(name) is stand_in:
        del sys.modules[name]
    return importlib.import_module(name)


class _OnCallModule(types.ModuleType):
    """Stand-in whose every public attribute is a function importing the real module and calling it."""

    def __getattr__(self, attribute: str) -> Callable[..., Any]:
        if attribute.startswith("__"):
            raise AttributeError(attribute)

        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(_real(self), attribute)(*args, **kwargs)

        call.__name__ = call.__qualname__ = attribute
        return call


def records_goodput(maxtext_args: Sequence[str]) -> bool:
    """Whether ``key=value`` arguments turn on one of :data:`GOODPUT_KEYS`."""
    return any(a.partition("=")[0] in GOODPUT_KEYS and a.partition("=")[2].lower() == "true" for a in maxtext_args)


def uploads_to_vertex_tensorboard(maxtext_args: Sequence[str], environ: Any = None) -> bool:
    """Whether the run uploads to Vertex AI TensorBoard: ``use_vertex_tensorboard=true`` (``configs/base.yml``:
    false) or ``UPLOAD_DATA_TO_TENSORBOARD`` set (MaxText 0.2.5 ``train.py``, ``train_loop``)."""
    import os

    env = os.environ if environ is None else environ
    on = any(a.partition("=")[0] == "use_vertex_tensorboard" and a.partition("=")[2].lower() == "true"
             for a in maxtext_args)  # fmt: skip
    return on or bool(env.get("UPLOAD_DATA_TO_TENSORBOARD"))


def install(maxtext_args: Sequence[str] = ()) -> None:
    """Prepare this process so that importing MaxText's trainer loads only what the step loop uses.

    Call before anything imports ``maxtext``. ``maxtext_args`` are the run's
    ``key=value`` MaxText arguments: with goodput recording or monitoring on
    (:data:`GOODPUT_KEYS`), ``ml_goodput_measurement`` is imported as usual.
    Modules already imported stay as they are.
    """
    for name in DEFERRED:
        if name not in sys.modules:
            sys.modules[name] = _DeferredModule(name, importlib.util.find_spec(name))
    for name in ON_CALL:
        sys.modules.setdefault(name, _OnCallModule(name))
    _import_refusing("tensorboardX", ["torch"])
    if not records_goodput(maxtext_args):
        _import_refusing("maxtext.common.goodput", ["ml_goodput_measurement"])
    refused = any(isinstance(f, _Refuser) and VERTEX_TENSORBOARD in f.names for f in sys.meta_path)
    if not uploads_to_vertex_tensorboard(maxtext_args) and not refused and VERTEX_TENSORBOARD not in sys.modules:
        sys.meta_path.insert(0, _Refuser([VERTEX_TENSORBOARD]))  # for the process: MaxText then uses its stub


def loaded(names: Sequence[str] = HEAVY) -> list[str]:
    """Which of the top-level packages ``names`` have really been imported (not a stand-in) in this process."""
    return sorted(
        n
        for n in names
        if (m := sys.modules.get(n)) is not None and not isinstance(m, (_DeferredModule, _OnCallModule))
    )
