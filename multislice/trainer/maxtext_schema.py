"""Extract MaxText's config schema for the pipeline environment (run in the trainer environment).

The pipeline environment cannot import MaxText, yet it must refuse a stage's
``maxtext_overrides`` key that MaxText would refuse only when a pod starts on
TPU. This module reads MaxText 0.2.5's own pydantic model of its config,
``MaxTextConfig`` in ``maxtext/configs/types.py`` (``extra="forbid"``: every key
MaxText accepts is one of its fields), and writes each field's JSON Schema
(type, enum, bounds from the ``Field`` constraints) together with the
activation names MaxText's MLP accepts (``maxtext/layers/linears.py``,
``_convert_to_activation_function``: ``linear``, ``sqrtsoftplus`` or a
function of ``jax.nn``).

Regenerate the committed file after a MaxText upgrade::

    PYTHONPATH=$PWD .venvs/trainer/bin/python -m multislice.trainer.maxtext_schema \
        > multislice/data/maxtext_config_schema.json

``tests/backends/local/test_trainer_env.py`` checks that the committed file matches the installed MaxText.
"""

from __future__ import annotations

import inspect
import json
import sys
from typing import Annotated, Any

from multislice import maxtext


def extract() -> dict[str, Any]:
    """The schema data: MaxText version, each config key's JSON Schema, and the activation names."""
    import jax.nn
    from maxtext.configs import types
    from pydantic import TypeAdapter

    fields = {}
    for key, field in sorted(types.MaxTextConfig.model_fields.items()):
        annotation: Any = Annotated[(field.annotation, *field.metadata)] if field.metadata else field.annotation
        fields[key] = TypeAdapter(annotation).json_schema()
    activations = sorted(
        {"linear", "sqrtsoftplus"}
        | {
            name
            for name, value in vars(jax.nn).items()
            if not name.startswith("_") and callable(value) and not inspect.isclass(value)
        }
    )
    return {
        "maxtext_version": maxtext.MAXTEXT_VERSION,
        "source": "maxtext/configs/types.py MaxTextConfig (extra=forbid); activations: maxtext/layers/linears.py",
        "activations": activations,
        "fields": fields,
    }


def render() -> str:
    """The committed file's text: :func:`extract` as sorted, indented JSON."""
    return json.dumps(extract(), indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
