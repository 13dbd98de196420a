"""multislice-pipelines: multislice TPU training as Kubeflow Pipelines, from config to verified checkpoint.

config -> plan -> manifests -> backend -> steps -> pipeline; see README.md.
"""

from typing import Any


def submit(*args: Any, **kwargs: Any) -> Any:
    """Validate, compile and submit one run to Vertex AI or KFP: :func:`multislice.delivery.submission.submit`.

    Imported on call, so that the trainer image (no kfp, no aiplatform) can import this package.
    """
    from multislice.delivery.submission import submit as _submit  # the trainer image has no kfp: on call

    return _submit(*args, **kwargs)


def run_local(*args: Any, **kwargs: Any) -> Any:
    """Run a profile on this machine as ``multislice run`` does; its ``RunRef``:
    :func:`multislice.delivery.submission.run_local`."""
    from multislice.delivery.submission import run_local as _run_local  # kfp, pydantic models: on call

    return _run_local(*args, **kwargs)


def remote(*args: Any, **kwargs: Any) -> Any:
    """Run a function on every host of a slice and return the leader's value: :func:`multislice.remote_call.remote`."""
    from multislice.remote_call import remote as _remote  # the pipeline image's modules: on call

    return _remote(*args, **kwargs)


def run_remote(*args: Any, **kwargs: Any) -> Any:
    """The plain function form of :func:`remote`: :func:`multislice.remote_call.run_remote`."""
    from multislice.remote_call import run_remote as _run_remote  # the pipeline image's modules: on call

    return _run_remote(*args, **kwargs)


def attach(*args: Any, **kwargs: Any) -> Any:
    """The handle of an earlier remote call, by its id: :func:`multislice.remote_call.attach`."""
    from multislice.remote_call import attach as _attach  # the pipeline image's modules: on call

    return _attach(*args, **kwargs)
