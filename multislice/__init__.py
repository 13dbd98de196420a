"""multislice-pipelines: multislice TPU training as Kubeflow Pipelines, from config to verified checkpoint.

config -> plan -> manifests -> backend -> steps -> pipeline; see README.md.
"""

from typing import Any


def submit(*args: Any, **kwargs: Any) -> Any:
    """Validate, compile and submit one run to Vertex AI or KFP: :func:`multislice.delivery.submission.submit`.

    Imported on call, so that the trainer image (no kfp, no aiplatform) can import this package.
    """
    from multislice.delivery.submission import submit as _submit

    return _submit(*args, **kwargs)
