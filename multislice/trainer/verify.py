"""Checkpoint verifier: is a stage's final Orbax checkpoint complete, the right model, and sane?

Usage (trainer environment)::

    python -m multislice.trainer.verify --checkpoint-dir DIR --expected-step N \
        [--report report.json] [--sample-bytes BYTES] -- key=value ...   # the stage's MaxText arguments

Checks, each reported with its evidence:

1. ``latest_step``: the newest checkpoint step equals the expected final step
   (MaxText counts steps from 0 and saves the last one, ``steps - 1``);
2. ``commit_markers``: the step was committed: ``commit_success.txt`` in the
   step and item directories, ``_CHECKPOINT_METADATA`` present, and no
   ``.orbax-checkpoint-tmp`` directory left for that step (Orbax writes to a
   temporary directory and renames it on commit);
3. ``params_tree``: the checkpoint's parameter tree has exactly the paths,
   shapes and dtypes of the model the MaxText arguments describe. The
   expected tree comes from MaxText's own model built from those arguments
   (``maxtext_utils.get_abstract_param``, an abstract ``jax.eval_shape``
   init), never from the checkpoint;
4. ``parameter_count``: the count of the expected tree equals the checkpoint's;
5. ``finite_samples``: the sampled parameter arrays (all of them when they fit
   in ``--sample-bytes``, else evenly spaced ones that fit) restore and hold
   only finite values.

The verdict is PASS when every check passes. Exit status: 0 on PASS, 1 on
FAIL, 2 when the verifier itself could not run (the report says why).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from multislice.maxtext import TRAIN_MODULE

DEFAULT_SAMPLE_BYTES = 256 * 1024**2
#: This module, as the trainer image runs it.
MODULE = "multislice.trainer.verify"


def command(checkpoint_dir: str, expected_step: int, maxtext_args: list[str], python: str = "python") -> list[str]:
    """The verifier's command line for a stage (an argument list, never a shell string)."""
    return [
        python, "-m", MODULE, "--checkpoint-dir", checkpoint_dir, "--expected-step", str(expected_step),
        "--", *maxtext_args,
    ]  # fmt: skip


def parse_report(output: str) -> dict[str, Any] | None:
    """The JSON report :func:`main` prints last: the last top-level ``{`` ... ``}`` block of ``output``, or None."""
    lines = output.splitlines()
    for start in range(len(lines) - 1, -1, -1):
        if lines[start].rstrip() == "{":
            try:
                return json.loads("\n".join(lines[start:]))
            except json.JSONDecodeError:
                return None
    return None


def checkpoint_path(text: str) -> Any:
    """A checkpoint directory as Orbax addresses it: an ``etils.epath.Path`` (local, or ``gs://`` on GKE).

    ``pathlib.Path`` would turn ``gs://bucket/x`` into ``gs:/bucket/x``.
    """
    from etils import epath

    return epath.Path(text)


def _keystr(path: tuple[Any, ...]) -> str:
    """``a/b/c`` for a pytree path; attribute steps (``.value`` of a boxed parameter) are dropped."""
    import jax

    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            continue
        parts.append(str(getattr(key, "key", getattr(key, "idx", key))))
    return "/".join(parts)


def expected_params(maxtext_args: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Parameter paths -> (shape, dtype) of the model the MaxText arguments describe.

    Parallelism arguments are dropped (they do not change parameter shapes)
    so that the model can be built on this single CPU process.
    """
    import jax
    from flax import linen as nn
    from maxtext import configs
    from maxtext.configs import pyconfig
    from maxtext.utils import maxtext_utils, model_creation_utils

    kept = [
        a for a in maxtext_args if not a.split("=", 1)[0].endswith("_parallelism") and not a.startswith("num_slices=")
    ]
    base_yml = str(Path(configs.__file__).with_name("base.yml"))
    config = pyconfig.initialize(
        [
            TRAIN_MODULE,
            base_yml,
            *kept,
            "skip_jax_distributed_system=true",
            "hardware=cpu",
            "enable_checkpointing=false",
        ]
    )
    model = model_creation_utils.from_config(config)
    abstract = nn.unbox(maxtext_utils.get_abstract_param(model, config))["params"]
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return {_keystr(path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in flat}


def _checkpoint_params(items_dir: Path) -> tuple[dict[str, Any], Any]:
    import jax
    import orbax.checkpoint as ocp

    tree = ocp.PyTreeCheckpointer().metadata(items_dir).item_metadata.tree
    params = tree["params"]["params"]
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return {_keystr(path): leaf for path, leaf in flat}, tree


def _check(name: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "detail": detail}


def choose_samples(sizes: dict[str, int], budget: int) -> list[str]:
    """Parameter paths to restore: all when they fit in ``budget`` bytes, else evenly spaced ones that fit."""
    paths = sorted(sizes)
    if sum(sizes.values()) <= budget:
        return paths
    chosen, used = [], 0
    step = max(1, len(paths) // 8)
    for path in paths[::step]:
        if used + sizes[path] <= budget:
            chosen.append(path)
            used += sizes[path]
    return chosen


def verify(checkpoint_dir: Path, expected_step: int, maxtext_args: list[str], sample_bytes: int) -> dict[str, Any]:
    """Run every check; returns the report (``verdict`` PASS or FAIL, ``checks``, evidence)."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    started = time.time()
    checks: list[dict[str, Any]] = []
    report: dict[str, Any] = {"checkpoint_dir": str(checkpoint_dir), "expected_step": expected_step}

    steps = ocp.CheckpointManager(checkpoint_dir).all_steps() if checkpoint_dir.is_dir() else []
    latest = max(steps) if steps else None
    report.update(all_steps=sorted(steps), latest_step=latest)
    checks.append(
        _check("latest_step", latest == expected_step, f"latest checkpoint step {latest}, expected {expected_step}")
    )
    if latest is None:
        return _finish(report, checks, started)

    step_dir = checkpoint_dir / str(latest)
    items_dir = step_dir / "items"
    leftovers = sorted(p.name for p in checkpoint_dir.iterdir() if p.name.startswith(f"{latest}.orbax-checkpoint-tmp"))
    markers = {
        "step commit_success.txt": (step_dir / "commit_success.txt").is_file(),
        "items commit_success.txt": (items_dir / "commit_success.txt").is_file(),
        "_CHECKPOINT_METADATA": (step_dir / "_CHECKPOINT_METADATA").is_file(),
    }
    missing = [name for name, ok in markers.items() if not ok]
    checks.append(
        _check(
            "commit_markers",
            not missing and not leftovers,
            "all commit markers present"
            if not missing and not leftovers
            else f"missing {missing}; uncommitted temporary directories {leftovers}",
        )
    )

    expected = expected_params(maxtext_args)
    found, tree = _checkpoint_params(items_dir)
    found_shapes = {path: (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in found.items()}
    missing_paths = sorted(set(expected) - set(found_shapes))
    extra_paths = sorted(set(found_shapes) - set(expected))
    mismatched = sorted(
        f"{p}: expected {expected[p][0]} {expected[p][1]}, found {found_shapes[p][0]} {found_shapes[p][1]}"
        for p in set(expected) & set(found_shapes)
        if expected[p] != found_shapes[p]
    )
    tree_ok = not (missing_paths or extra_paths or mismatched)
    checks.append(
        _check(
            "params_tree",
            tree_ok,
            f"{len(expected)} parameter arrays match the model's paths, shapes and dtypes"
            if tree_ok
            else f"missing {missing_paths[:5]}, unexpected {extra_paths[:5]}, mismatched {mismatched[:5]}",
        )
    )
    expected_count = int(sum(np.prod(shape) for shape, _ in expected.values()))
    found_count = int(sum(np.prod(shape) for shape, _ in found_shapes.values()))
    report.update(parameter_count=found_count, expected_parameter_count=expected_count)
    checks.append(
        _check(
            "parameter_count",
            expected_count == found_count,
            f"{found_count:,} parameters in the checkpoint, {expected_count:,} in the model",
        )
    )
    any_leaf = next(iter(found.values()))
    sharding = getattr(any_leaf, "sharding", None)
    if sharding is not None and getattr(sharding, "axis_names", None):
        report["written_mesh"] = {
            name: int(size)
            for name, size in zip(sharding.axis_names, np.asarray(sharding.shape).tolist(), strict=False)
            if size != 1
        }

    sizes = {p: int(np.prod(found_shapes[p][0])) * np.dtype(found_shapes[p][1]).itemsize for p in found_shapes}
    chosen = choose_samples(sizes, sample_bytes)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    item: dict[str, Any] = {}
    for path in chosen:
        node = item.setdefault("params", {}).setdefault("params", {})
        *parents, leaf = path.split("/")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = found[path]
    item["step"] = tree["step"]
    restore_args = jax.tree_util.tree_map(
        lambda m: ocp.ArrayRestoreArgs(sharding=device, global_shape=m.shape, dtype=m.dtype), item
    )
    restored = ocp.PyTreeCheckpointer().restore(
        items_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    )
    samples = []
    for path, array in jax.tree_util.tree_flatten_with_path(restored["params"]["params"])[0]:
        values = np.asarray(array)
        samples.append(
            {
                "path": _keystr(path),
                "shape": list(values.shape),
                "finite": bool(np.isfinite(values).all()),
                "mean_abs": float(np.abs(values).mean()),
            }
        )
    report["state_step"] = int(np.asarray(restored["step"]))
    report["samples"] = samples
    bad = [s["path"] for s in samples if not s["finite"]]
    checks.append(
        _check(
            "finite_samples",
            bool(samples) and not bad,
            f"{len(samples)} of {len(found)} arrays restored, all finite"
            if samples and not bad
            else f"non-finite values in {bad}"
            if bad
            else "no array fit the sample budget",
        )
    )
    return _finish(report, checks, started)


def _finish(report: dict[str, Any], checks: list[dict[str, Any]], started: float) -> dict[str, Any]:
    report["checks"] = checks
    report["verdict"] = "PASS" if checks and all(c["passed"] for c in checks) else "FAIL"
    report["seconds"] = round(time.time() - started, 2)
    return report


def main(argv: list[str] | None = None) -> int:
    """CLI entry; writes the JSON report to ``--report`` (and stdout). Exit 0 PASS, 1 FAIL, 2 error."""
    argv = sys.argv[1:] if argv is None else argv
    own, maxtext_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m multislice.trainer.verify", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, type=checkpoint_path)
    parser.add_argument("--expected-step", required=True, type=int)
    parser.add_argument("--report", type=Path, help="write the JSON report here too")
    parser.add_argument("--sample-bytes", type=int, default=DEFAULT_SAMPLE_BYTES)
    options = parser.parse_args(own)
    if not maxtext_args:
        parser.error("give the stage's MaxText arguments after --, so the expected model can be built")
    try:
        report = verify(options.checkpoint_dir, options.expected_step, maxtext_args, options.sample_bytes)
        status = 0 if report["verdict"] == "PASS" else 1
    except Exception as error:  # the report must say why the verifier could not run
        report = {
            "verdict": "ERROR",
            "error": f"{type(error).__name__}: {error}",
            "checkpoint_dir": str(options.checkpoint_dir),
        }
        status = 2
    text = json.dumps(report, indent=1)
    if options.report:
        options.report.parent.mkdir(parents=True, exist_ok=True)
        options.report.write_text(text, encoding="utf-8")
    print(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
