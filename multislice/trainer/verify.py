"""Checkpoint verifier: is a stage's final Orbax checkpoint complete, the right model, and the one trained?

Usage (trainer environment)::

    python -m multislice.trainer.verify --checkpoint-dir DIR --expected-step N \
        [--report report.json] [--sample-bytes BYTES] [--full-check-bytes BYTES] [--metrics-file FILE] \
        [--loss-rtol R] [--loss-check-flops F] -- key=value ...   # the stage's MaxText arguments

Checks, each reported with its evidence (a failure names the step and the array):

1. ``latest_step``: the newest checkpoint step equals the expected final step
   (MaxText counts steps from 0 and saves the last one, ``steps - 1``);
2. ``commit_markers``: the step was committed: ``commit_success.txt`` in the
   step and item directories, ``_CHECKPOINT_METADATA`` present, and no
   ``.orbax-checkpoint-tmp`` directory left for that step (Orbax writes to a
   temporary directory and renames it on commit);
3. ``checksums``: every file of the step has the size and CRC-32C recorded when
   the step committed (:mod:`multislice.trainer.digests`: the worker's leader
   writes ``<step>/multislice_digests.json``); a missing, truncated, garbage or
   changed file is named with its path, what it is, and the arrays it holds (with
   chunk digests, the array whose bytes changed). A step without a record in a
   checkpoint directory this project's trainer wrote (its digest ledger,
   :data:`multislice.trainer.digests.LEDGER_FILE`, is there) fails, naming the
   missing record; one from elsewhere (no ledger) is SKIPPED, saying so, once every
   data file the OCDBT manifest refers to is there and long enough;
4. ``metadata``: the layout is the one expected (:data:`LAYOUT`): the item's tree
   metadata (``_METADATA``) reads and holds MaxText's TrainState, ``_sharding``
   and ``manifest.ocdbt`` are there, and ``array_metadatas/process_*`` list every array
   (a missing or non-JSON ``_METADATA`` and a missing ``manifest.ocdbt`` are told apart);
5. ``recorded_step``: the TrainState ``step`` stored in the directory equals its
   name + 1 (``maxtext/common/checkpointing.py``, ``maybe_save_checkpoint``: the
   directory of step N holds ``state.step - 1 == N``), so a stale step renamed to
   the final one fails (Orbax's ``_CHECKPOINT_METADATA`` does not record the step);
6. ``params_tree``: the checkpoint's parameter tree has exactly the paths,
   shapes and dtypes of the model the MaxText arguments describe. The
   expected tree comes from MaxText's own model built from those arguments
   (``maxtext_utils.get_abstract_param``, an abstract ``jax.eval_shape``
   init), never from the checkpoint;
7. ``parameter_count``: the count of the expected tree equals the checkpoint's;
8. ``finite_arrays``: every array (parameters, optimizer state, counters) restores
   and holds only finite values when the checkpoint is at most
   :data:`FULL_CHECK_BYTES` (4 GiB); a larger one has evenly spaced arrays up to
   ``--sample-bytes`` checked. Arrays are restored in chunks of at most
   ``--sample-bytes`` (256 MiB) or one array, which bounds the memory;
9. ``loss_replay`` (functional): MaxText logs the loss of step S computed with the
   parameters checkpoint S-1 holds, and with ``dataset_type=synthetic`` the batch
   is the same at every step. The newest checkpoint S-1 whose step S was logged is
   evaluated on that batch and must give the logged loss (TensorBoard's float32,
   else metrics.jsonl's 3 decimals) within :data:`LOSS_RTOL` relative;
10. ``final_loss`` (functional, on the final checkpoint, which has no logged next
   step): its loss must continue the logged curve (:func:`loss_checks`).

The loss checks restore one checkpoint's parameters at a time (memory: the
parameters plus :data:`LOGITS_BYTES` of logits) and run only when a forward pass
costs at most :data:`LOSS_CHECK_FLOPS`; else they are reported as skipped.

The verdict is PASS when every check passes; a check that could not run on this
checkpoint (``skipped: true``) does not fail it, and is listed in the report's
``skipped``. Exit status: 0 on PASS, 1 on FAIL, 2 when the verifier itself could
not run (the report says why).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from multislice.maxtext import TRAIN_MODULE
from multislice.trainer import digests, lean_imports

#: Checkpoints up to this size (bytes, all arrays: parameters and optimizer state) have every array
#: restored and checked; larger ones a sample of at most ``--sample-bytes`` (plus the loss replay).
FULL_CHECK_BYTES = 4 * 1024**3
#: Arrays are restored in chunks of at most this many bytes (or one array, if larger): the memory bound.
DEFAULT_SAMPLE_BYTES = 256 * 1024**2
#: Relative tolerance of the loss replay. Measured: the 16-device CPU run's float32 TensorBoard loss and
#: this single-device replay differ by 1.1e-5 relative (7.5e-5 at loss 7.14); one training step of the
#: local demo changes the loss by about 8e-4 relative, so a stale checkpoint lies outside it.
LOSS_RTOL = 2e-4
#: The loss checks run when one forward pass over the logged batch costs at most this many FLOPs
#: (2 x parameters x tokens): about a minute on a few CPU cores at 1e11 FLOP/s; larger models are skipped.
LOSS_CHECK_FLOPS = 1e13
#: Logits held at once by the loss checks (the batch goes through in chunks of rows), bytes.
LOGITS_BYTES = 256 * 1024**2
#: What the verifier expects to find.
LAYOUT = (
    "an Orbax CheckpointManager directory <checkpoints>/<step>/items with _METADATA, _sharding, manifest.ocdbt "
    "and array_metadatas/, holding MaxText's TrainState {params: {params: ...}, opt_state, step}"
)
EXPECTED_ITEM_FILES = ("_METADATA", "_sharding", "manifest.ocdbt")  # commit_success.txt: commit_markers
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


def _config(maxtext_args: list[str]) -> Any:
    """MaxText's config of the stage, for this single CPU process.

    Parallelism arguments are dropped (they do not change parameter shapes or the loss).
    """
    from maxtext import configs
    from maxtext.configs import pyconfig

    kept = [
        a for a in maxtext_args if not a.split("=", 1)[0].endswith("_parallelism") and not a.startswith("num_slices=")
    ]
    base_yml = str(Path(configs.__file__).with_name("base.yml"))
    return pyconfig.initialize(
        [
            TRAIN_MODULE,
            base_yml,
            *kept,
            "skip_jax_distributed_system=true",
            "hardware=cpu",
            "enable_checkpointing=false",
        ]
    )


def expected_params(maxtext_args: list[str]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Parameter paths -> (shape, dtype) of the model the MaxText arguments describe.

    Built on this single CPU process (:func:`_config`).
    """
    import jax
    from flax import linen as nn
    from maxtext.utils import maxtext_utils, model_creation_utils

    config = _config(maxtext_args)
    model = model_creation_utils.from_config(config)
    abstract = nn.unbox(maxtext_utils.get_abstract_param(model, config))["params"]
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    return {_keystr(path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in flat}


def _check(name: str, passed: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "passed": bool(passed), "detail": detail}


def _skipped(name: str, detail: str) -> dict[str, Any]:
    """A check that could not run on this checkpoint: it does not fail the verdict, and is never shown as PASS."""
    return {"name": name, "passed": True, "skipped": True, "detail": detail}


def choose_samples(sizes: dict[str, int], budget: int) -> list[str]:
    """Array paths to restore: all when they fit in ``budget`` bytes, else evenly spaced ones that fit."""
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


def _error(error: BaseException) -> str:
    """An exception as one short line for a check's detail (TensorStore's source locations and spec dropped)."""
    return digests.summarize_error(error)


def _leaves(tree: Any) -> dict[str, Any]:
    """``path -> leaf`` of a checkpoint's tree metadata (``opt_state/0/mu/params/...``)."""
    import jax

    return {_keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _nbytes(leaf: Any) -> int:
    import numpy as np

    return int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize


def restore_arrays(items_dir: Any, tree: Any, wanted: list[str]) -> dict[str, Any]:
    """Restore the arrays at ``wanted`` paths of a checkpoint item onto this process's first device.

    Other leaves are skipped (``orbax.checkpoint.PLACEHOLDER``), so memory is the size of those arrays.

    Returns:
        path -> numpy array.

    Raises:
        Exception: whatever Orbax / TensorStore raise for an unreadable array.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    keep = set(wanted)
    item = jax.tree_util.tree_map_with_path(lambda p, leaf: leaf if _keystr(p) in keep else ocp.PLACEHOLDER, tree)

    def args(leaf: Any) -> Any:
        if leaf is ocp.PLACEHOLDER:
            return leaf
        return ocp.ArrayRestoreArgs(sharding=device, global_shape=leaf.shape, dtype=leaf.dtype)

    restore_args = jax.tree_util.tree_map(args, item, is_leaf=lambda x: x is ocp.PLACEHOLDER)
    restored = ocp.PyTreeCheckpointer().restore(
        items_dir, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args)
    )
    flat = jax.tree_util.tree_flatten_with_path(restored, is_leaf=lambda x: x is ocp.PLACEHOLDER)[0]

    def values(leaf: Any) -> Any:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(leaf))  # a PRNG key array (nnx_aux rngs)
        return np.asarray(leaf)

    return {_keystr(p): values(leaf) for p, leaf in flat if leaf is not ocp.PLACEHOLDER and _keystr(p) in keep}


def check_arrays(items_dir: Any, tree: Any, wanted: list[str], chunk_bytes: int) -> tuple[list[str], list[str], int]:
    """Restore ``wanted`` arrays in chunks of at most ``chunk_bytes`` (or one array) and check they are finite.

    A chunk that fails to restore is retried array by array, so an unreadable array is named.

    Returns:
        ``(unreadable, non_finite, restored)``: ``path: error`` lines, paths with NaN/Inf, arrays restored.
    """
    import numpy as np

    leaves = _leaves(tree)
    chunks: list[list[str]] = [[]]
    used = 0
    for path in wanted:
        size = _nbytes(leaves[path])
        if chunks[-1] and used + size > chunk_bytes:
            chunks.append([])
            used = 0
        chunks[-1].append(path)
        used += size
    unreadable, non_finite, restored = [], [], 0
    for chunk in chunks:
        try:
            groups = [restore_arrays(items_dir, tree, chunk)]
        except Exception:  # noqa: BLE001 - find which array is unreadable
            groups = []
            for path in chunk:
                try:
                    groups.append(restore_arrays(items_dir, tree, [path]))
                except Exception as error:  # noqa: BLE001 - reported as the check's evidence
                    unreadable.append(f"{path}: {_error(error)}")
        for group in groups:
            for path, values in group.items():
                restored += 1
                if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
                    bad = int((~np.isfinite(values)).sum())
                    non_finite.append(f"{path} ({bad} of {values.size} values NaN/Inf)")
    return unreadable, non_finite, restored


def metadata_problems(items_dir: Any, tree: Any) -> list[str]:
    """What is missing or inconsistent in an item's Orbax metadata files (empty when all is there).

    Orbax's PyTree layout (``orbax/checkpoint/_src/handlers/base_pytree_checkpoint_handler.py``):
    ``_METADATA`` (the tree), ``_sharding``, ``manifest.ocdbt`` (the OCDBT root) and
    ``array_metadatas/process_<i>`` (each process's arrays, by ``param_name`` = the dotted tree path).
    """
    problems = [f"{name} missing in {items_dir}" for name in EXPECTED_ITEM_FILES if not (items_dir / name).exists()]
    listed: set[str] = set()
    metadata_dir = items_dir / "array_metadatas"
    files = sorted(metadata_dir.glob("process_*")) if metadata_dir.is_dir() else []
    if not files:
        problems.append(f"no array_metadatas/process_* in {items_dir} (Orbax writes one per process)")
    for path in files:
        try:
            for entry in json.loads(path.read_text())["array_metadatas"]:
                listed.add(entry["array_metadata"]["param_name"])
        except (ValueError, KeyError, TypeError) as error:
            problems.append(f"{path.name} unreadable: {_error(error)}")
    if files and tree is not None:
        unlisted = sorted(p for p in _leaves(tree) if p.replace("/", ".") not in listed)
        if unlisted:
            problems.append(f"{len(unlisted)} arrays not in array_metadatas, e.g. {unlisted[:3]}")
    return problems


def verify(
    checkpoint_dir: Any,
    expected_step: int,
    maxtext_args: list[str],
    sample_bytes: int = DEFAULT_SAMPLE_BYTES,
    full_check_bytes: int = FULL_CHECK_BYTES,
    metrics_file: Any = None,
    loss_rtol: float = LOSS_RTOL,
    loss_flops: float = LOSS_CHECK_FLOPS,
) -> dict[str, Any]:
    """Run every check; returns the report (``verdict`` PASS or FAIL, ``checks``, evidence).

    A damaged checkpoint is a FAIL whose check names the array and step; checks that cannot run
    after an earlier failure (no tree to read) are reported as failed with the reason.
    """
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
        checks.append(_check("layout", False, f"no step directories in {checkpoint_dir}; expected {LAYOUT}"))
        return _finish(report, checks, started)

    step_dir = checkpoint_dir / str(latest)
    items_dir = digests.item_dir(step_dir)  # items, or default with emergency checkpoints
    leftovers = sorted(p.name for p in checkpoint_dir.iterdir() if p.name.startswith(f"{latest}.orbax-checkpoint-tmp"))
    markers = {
        "step commit_success.txt": (step_dir / "commit_success.txt").is_file(),
        f"{items_dir.name} commit_success.txt": (items_dir / "commit_success.txt").is_file(),
        "_CHECKPOINT_METADATA": (step_dir / "_CHECKPOINT_METADATA").is_file(),
    }
    missing = [name for name, ok in markers.items() if not ok]
    checks.append(
        _check(
            "commit_markers",
            not missing and not leftovers,
            "all commit markers present"
            if not missing and not leftovers
            else f"step {latest}: missing {missing}; uncommitted temporary directories {leftovers}",
        )
    )

    checks.append(checksum_check(step_dir, latest, report))

    if not items_dir.is_dir():
        found = sorted(p.name for p in step_dir.iterdir()) if step_dir.is_dir() else []
        checks.append(
            _check("metadata", False, f"step {latest}: no items directory (found {found}); expected {LAYOUT}")
        )
        return _finish(report, checks, started)
    tree, why = _tree(items_dir)
    problems = ([why] if why else []) + metadata_problems(items_dir, tree)
    checks.append(
        _check(
            "metadata",
            not problems,
            f"step {latest}: tree, sharding, OCDBT manifest and array metadata of {len(_leaves(tree))} arrays present"
            if not problems
            else f"step {latest}: " + "; ".join(problems[:4]),
        )
    )
    if tree is None:
        return _finish(report, checks, started)

    try:
        recorded = int(restore_arrays(items_dir, tree, ["step"])["step"])
    except Exception as error:  # noqa: BLE001 - a damaged step counter is a finding
        recorded, detail = None, f"step {latest}: the recorded step could not be restored: {_error(error)}"
    else:
        detail = f"directory {latest} holds the state after step {recorded - 1} (TrainState step {recorded})" + (
            "" if recorded == latest + 1 else f"; MaxText saves step N with TrainState step N+1: expected {latest + 1}"
        )
    report["state_step"] = recorded
    checks.append(_check("recorded_step", recorded == latest + 1, detail))

    expected = expected_params(maxtext_args)
    found = {
        p.removeprefix("params/params/"): leaf for p, leaf in _leaves(tree).items() if p.startswith("params/params/")
    }
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
    if found:
        sharding = getattr(next(iter(found.values())), "sharding", None)
        if sharding is not None and getattr(sharding, "axis_names", None):
            report["written_mesh"] = {
                name: int(size)
                for name, size in zip(sharding.axis_names, np.asarray(sharding.shape).tolist(), strict=False)
                if size != 1
            }

    sizes = {p: _nbytes(leaf) for p, leaf in _leaves(tree).items()}
    total = sum(sizes.values())
    full = total <= full_check_bytes
    chosen = sorted(sizes) if full else choose_samples(sizes, sample_bytes)
    unreadable, non_finite, restored = check_arrays(items_dir, tree, chosen, sample_bytes)
    report["array_check"] = {
        "mode": "all" if full else "sample",
        "checkpoint_bytes": total,
        "full_check_bytes": full_check_bytes,
        "arrays": len(sizes),
        "restored": restored,
        "checked": chosen if not full else len(chosen),
    }
    what = f"all {len(sizes)} arrays" if full else f"{len(chosen)} of {len(sizes)} arrays (sample, {total:,} bytes)"
    checks.append(
        _check(
            "finite_arrays",
            bool(chosen) and not unreadable and not non_finite,
            f"step {latest}: {what} (parameters and optimizer state) restored, all finite"
            if chosen and not unreadable and not non_finite
            else f"step {latest}: "
            + "; ".join(
                ([f"unreadable: {unreadable[:3]}"] if unreadable else [])
                + ([f"non-finite: {non_finite[:5]}"] if non_finite else [])
            )
            or "no array fit the sample budget",
        )
    )

    if not tree_ok:
        checks.append(_check("loss_replay", False, "not run: the parameter tree is not the model's (params_tree)"))
        return _finish(report, checks, started)
    checks += loss_checks(checkpoint_dir, sorted(steps), maxtext_args, metrics_file, loss_rtol, report, loss_flops)
    return _finish(report, checks, started)


def checksum_check(step_dir: Any, step: int, report: dict[str, Any]) -> dict[str, Any]:
    """``checksums``: every file of the step has the size and CRC-32C recorded when it committed.

    The record is :data:`multislice.trainer.digests.DIGEST_FILE`, written by the stage's leader process after
    the commit; the leader also writes :data:`multislice.trainer.digests.LEDGER_FILE` in the checkpoint directory.
    A step without a record fails when that ledger is there (this project's trainer wrote the directory: the
    record was deleted, or never written), and is SKIPPED (``skipped: true``, not failing the verdict) when it is
    not (a checkpoint from elsewhere, or from before digests were recorded): its bytes cannot be checked, only
    what the OCDBT manifest refers to (a missing or short file fails either way). An unreadable record fails.
    """
    found, why = digests.read_record(step_dir)
    if found is None and why == "absent":
        problems, files = digests.reference_problems(step_dir)
        ledger, ledger_why = digests.read_ledger(step_dir.parent)
        ours = ledger_why != "absent"
        report["checksums"] = {"recorded": False, "ledger": ours, "referenced_files": files, "problems": problems}
        if ours:
            return _check(
                "checksums",
                False,
                f"step {step}: its digest record {digests.DIGEST_FILE} is missing, though this checkpoint directory "
                f"was written with digests ({digests.LEDGER_FILE}"
                + (f": {ledger_why}" if ledger_why else "")
                + "): the record was deleted or never written, so changed bytes cannot be found; restore the record "
                "with the step (a copy of both), or treat the step as suspect and resume from an earlier one"
                + ("; also " + "; ".join(problems[:6]) if problems else ""),
            )
        absent = (
            f"step {step}: no digests recorded ({digests.DIGEST_FILE} and {digests.LEDGER_FILE} absent: a checkpoint "
            "not written by this project's trainer, or from before it recorded digests), so changed bytes cannot be "
            "found"
        )
        if problems:
            return _check("checksums", False, f"{absent}; but " + "; ".join(problems[:6]))
        return _skipped(
            "checksums",
            f"SKIPPED: {absent}; the {files} data files the OCDBT manifest refers to are all there and long enough; "
            "the other checks still run",
        )
    if found is None:
        report["checksums"] = {"recorded": False, "error": why}
        return _check("checksums", False, f"step {step}: {why}")
    try:
        problems, evidence = digests.check(step_dir, found)
    except Exception as error:  # noqa: BLE001 - an unreadable directory is a finding
        problems, evidence = [f"the step directory could not be read: {_error(error)}"], {}
    report["checksums"] = {"recorded": True, "chunk_digests": bool(found.get("chunk_digests")), **evidence}
    if not problems:
        return _check(
            "checksums",
            True,
            f"step {step}: all {len(found['files'])} files match the sizes and CRC-32C recorded at commit",
        )
    return _check("checksums", False, f"step {step}: " + "; ".join(problems[:6]))


def _tree(items_dir: Any) -> tuple[Any, str]:
    """The item's tree metadata (Orbax ``_METADATA``), or None and why it cannot be used.

    A missing or non-JSON ``_METADATA`` is named as such; so is a missing ``manifest.ocdbt``, without which
    Orbax reports no tree at all (it reads the metadata through the OCDBT database).
    """
    import orbax.checkpoint as ocp

    metadata_file = items_dir / "_METADATA"
    if not metadata_file.exists():
        return None, f"_METADATA (the tree metadata) missing in {items_dir}; expected {LAYOUT}"
    try:
        json.loads(metadata_file.read_bytes())
    except ValueError as error:
        return None, f"_METADATA (the tree metadata) in {items_dir} is not JSON (garbage): {_error(error)}"
    try:
        metadata = ocp.PyTreeCheckpointer().metadata(items_dir)
    except Exception as error:  # noqa: BLE001 - unreadable metadata is a finding
        return None, f"tree metadata unreadable: {_error(error)}; expected {LAYOUT}"
    tree = getattr(getattr(metadata, "item_metadata", None), "tree", None)
    if tree is None and not (items_dir / "manifest.ocdbt").exists():
        return None, (
            f"manifest.ocdbt (the OCDBT manifest, the root of the array database) missing in {items_dir}: "
            "no array can be read"
        )
    if tree is None:
        return None, f"no tree in _METADATA of {items_dir} (it parses, but Orbax finds no tree); expected {LAYOUT}"
    absent = [key for key in ("params", "opt_state", "step") if key not in tree]
    if absent or "params" not in tree.get("params", {}):
        return None, f"the tree has {sorted(tree)} at the top; expected {LAYOUT}"
    return tree, ""


def logged_losses(metrics_file: Any, tensorboard_dir: Any) -> tuple[dict[int, float], str, float]:
    """The run's logged loss per step: ``(step -> loss, source, rounding)``.

    MaxText writes ``learning/loss`` of every step to TensorBoard as a float32
    (``maxtext/common/metric_logger.py``); the train step's ``metrics.jsonl``
    has it from the log line, rounded to 3 decimals (``rounding`` 5e-4). The
    TensorBoard events are read when present, else the JSON lines. Steps TensorBoard lacks are taken from the
    JSON lines (then ``rounding`` is theirs): a JobSet stopped by an elastic resize right after a checkpoint may
    not have flushed its last steps' events, while the train step read their log lines.
    """
    losses: dict[int, float] = {}
    if tensorboard_dir is not None and tensorboard_dir.is_dir():
        try:
            # MaxText writes <base_output_directory>/<run_name>/tensorboard/<run_name>/events.out.tfevents.*
            for events in sorted(tensorboard_dir.glob("*/events.out.tfevents.*")):
                losses.update(_tensorboard_losses(events.read_bytes()))
        except Exception:  # noqa: BLE001 - fall back to the JSON lines
            losses = {}
    logged: dict[int, float] = {}
    if metrics_file is not None and metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if "learning/loss" in record:
                    logged[int(record["step"])] = float(record["learning/loss"])
    if losses:
        missing = {step: loss for step, loss in logged.items() if step not in losses}
        if not missing:
            return losses, str(tensorboard_dir), 0.0
        return {**missing, **losses}, f"{tensorboard_dir} (steps it lacks from {metrics_file})", 5e-4
    return logged, str(metrics_file), 5e-4 if logged else 0.0


def _tensorboard_losses(data: bytes) -> dict[int, float]:
    """``learning/loss`` per step from a TFRecord file of TensorBoard events (8-byte length, CRC, event, CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    losses, offset = {}, 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        # protobuf makes the module's message classes at import: the checker cannot see them
        event = event_pb2.Event()  # pyright: ignore[reportAttributeAccessIssue]
        event.ParseFromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4
        for value in event.summary.value:
            if value.tag == "learning/loss" and value.HasField("simple_value"):
                losses[int(event.step)] = float(value.simple_value)
    return losses


def synthetic_loss(items_dir: Any, tree: Any, maxtext_args: list[str], devices: int) -> float:
    """MaxText's training loss of the checkpoint's parameters on the run's synthetic batch, on this process.

    The batch is the one ``SyntheticDataIterator`` (``maxtext/input_pipeline/synthetic_data_processing.py``)
    yields at every step: ``jax.random.randint(PRNGKey(0), (global_batch_size_to_load, max_target_length + 1),
    0, vocab_size)`` under the ``unsafe_rbg`` PRNG that ``train.initialize`` sets; inputs and targets are
    its shifted halves, all positions in segment 1. The loss is ``loss_fn``'s (``maxtext/trainers/pre_train/
    train.py``): cross-entropy summed over target tokens / (their count + EPS), without dropout.
    """
    import jax
    import jax.numpy as jnp
    from maxtext.utils import max_utils, model_creation_utils

    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    config = _config(maxtext_args)
    batch = int(devices * config.per_device_batch_size)
    length = config.max_target_length
    tokens = jax.random.randint(jax.random.PRNGKey(0), (batch, length + 1), 0, config.vocab_size, dtype=jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    segments = jnp.ones((batch, length), jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    wanted = [p for p in _leaves(tree) if p.startswith("params/params/")]
    flat = restore_arrays(items_dir, tree, wanted)
    params: dict[str, Any] = {}
    for path, values in flat.items():
        node = params
        *parents, leaf = path.split("/")[1:]
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = jnp.asarray(values)
    model = model_creation_utils.from_config(config)
    key = jax.random.PRNGKey(0)

    @jax.jit
    def xent_sum(variables: Any, inputs: Any, positions: Any, segments: Any, targets: Any) -> Any:
        logits = model.apply(
            variables, inputs, positions, decoder_segment_ids=segments, enable_dropout=False,
            rngs={"aqt": key, "params": key}, decoder_target_tokens=targets, decoder_target_mask=segments,
        )  # fmt: skip
        one_hot = jax.nn.one_hot(targets, config.vocab_size)
        xent, _ = max_utils.cross_entropy_with_logits(logits, one_hot, z_loss=config.z_loss_multiplier)
        return jnp.sum(xent * (segments != 0), dtype=jnp.float32)

    # The sum is additive over rows: rows go through in chunks whose logits fit in LOGITS_BYTES.
    fit = max(1, LOGITS_BYTES // (length * config.vocab_size * 4))
    rows = max(r for r in range(1, min(fit, batch) + 1) if batch % r == 0)
    total = sum(
        float(xent_sum(params, *(a[i : i + rows] for a in (inputs, positions, segments, targets))))
        for i in range(0, batch, rows)
    )
    return total / (float(jnp.sum(segments != 0)) + 1e-8)


def _devices(maxtext_args: list[str]) -> int | None:
    """Devices the stage trained on: the product of its ``ici_*`` and ``dcn_*`` parallelism (None if one is -1)."""
    devices = 1
    for arg in maxtext_args:
        key, _, value = arg.partition("=")
        if key.endswith("_parallelism") and (key.startswith("ici_") or key.startswith("dcn_")):
            if int(value) < 1:
                return None
            devices *= int(value)
    return devices


def _evaluate(checkpoint_dir: Any, step: int, maxtext_args: list[str], devices: int) -> tuple[float | None, str]:
    """The synthetic-batch loss of checkpoint ``step``'s parameters, or None and why it could not be computed."""
    items_dir = digests.item_dir(checkpoint_dir / str(step))
    tree, why = _tree(items_dir)
    try:
        if tree is None:
            raise ValueError(why)
        return synthetic_loss(items_dir, tree, maxtext_args, devices), ""
    except Exception as error:  # noqa: BLE001 - a checkpoint that cannot be evaluated fails the check
        return None, f"step {step}: parameters could not be evaluated: {_error(error)}"


def loss_checks(
    checkpoint_dir: Any,
    steps: list[int],
    maxtext_args: list[str],
    metrics_file: Any,
    rtol: float,
    report: dict,
    max_flops: float = LOSS_CHECK_FLOPS,
) -> list[dict[str, Any]]:
    """The functional checks: a checkpoint's parameters give the loss the run logged with them.

    ``loss_replay``: MaxText logs the loss of step S computed with the parameters before update S,
    which checkpoint S-1 holds (it saves after step S-1 with TrainState step S). The newest checkpoint
    whose next step was logged is evaluated on the synthetic batch and must match that step's logged
    loss within ``rtol`` relative (plus the log's rounding).

    ``final_loss`` (when the final checkpoint has no logged next step, as usual): the final checkpoint's
    loss must continue the logged curve: within the largest of the last three logged step-to-step
    changes (plus ``rtol``) of ``loss[L] + (loss[L] - loss[L-1])``, the loss one more step along the
    curve (L = the final step). Weaker than the replay, but it is the final checkpoint's own check.
    """
    args = dict(a.split("=", 1) for a in maxtext_args if "=" in a)
    devices = _devices(maxtext_args)
    skip = (
        "only a synthetic-data stage's batch can be rebuilt"
        if args.get("dataset_type", "tfds") != "synthetic"
        else "the batch size needs explicit ici_*/dcn_* parallelism and no gradient accumulation"
        if devices is None or int(args.get("gradient_accumulation_steps", "1")) != 1
        else ""
    )
    if skip or devices is None:  # devices is None only with a skip
        report["loss_check"] = f"skipped: {skip}"
        return [_skipped("loss_replay", f"skipped: {skip}")]
    tensorboard = (
        checkpoint_path(f"{args['base_output_directory']}/{args['run_name']}/tensorboard")
        if "base_output_directory" in args and "run_name" in args
        else None
    )
    config = _config(maxtext_args)
    flops = 2 * report.get("parameter_count", 0) * devices * config.per_device_batch_size * config.max_target_length
    if flops > max_flops:
        report["loss_check"] = f"skipped: {flops:.2e} FLOPs per forward pass > {max_flops:.2e}"
        return [_skipped("loss_replay", f"skipped: a forward pass costs {flops:.2e} FLOPs > {max_flops:.2e}")]
    losses, source, rounding = logged_losses(metrics_file, tensorboard)
    candidates = [s for s in steps if s + 1 in losses]
    if not candidates:
        return [
            _check("loss_replay", False, f"no checkpoint step S with a logged loss of step S+1 in {source} ({steps})")
        ]
    results = []
    step = max(candidates)
    logged = losses[step + 1]
    tolerance = rtol * abs(logged) + rounding
    computed, why = _evaluate(checkpoint_dir, step, maxtext_args, devices)
    report["loss_replay"] = {
        "checkpoint_step": step, "logged_step": step + 1, "logged_loss": logged, "computed_loss": computed,
        "tolerance": tolerance, "source": source,
    }  # fmt: skip
    results.append(_compare("loss_replay", step, computed, why, logged, tolerance, f"logged at step {step + 1}"))
    final = max(steps)
    if step == final:
        return results
    recent = [losses[final - i] for i in range(4) if final - i in losses]
    if len(recent) < 4:
        results.append(_check("final_loss", False, f"step {final}: steps {final - 3}..{final} not all in {source}"))
        return results
    changes = [abs(recent[i] - recent[i + 1]) for i in range(3)]
    expected = recent[0] + (recent[0] - recent[1])
    tolerance = max(changes) + rtol * abs(expected) + rounding
    computed, why = _evaluate(checkpoint_dir, final, maxtext_args, devices)
    report["final_loss"] = {
        "checkpoint_step": final, "expected_loss": expected, "computed_loss": computed, "tolerance": tolerance,
        "source": source,
    }  # fmt: skip
    results.append(
        _compare("final_loss", final, computed, why, expected, tolerance, f"expected from the curve after step {final}")
    )
    return results


def _compare(name: str, step: int, computed: float | None, why: str, reference: float, tolerance: float, what: str):
    if computed is None:
        return _check(name, False, why)
    difference = abs(computed - reference)
    passed = difference <= tolerance  # False for NaN
    return _check(
        name,
        passed,
        f"step {step}: loss {computed:.6f} on the synthetic batch, {reference:.6f} {what}; "
        f"|difference| {difference:.2e} {'<=' if passed else '>'} tolerance {tolerance:.2e}"
        + ("" if passed else " (the parameters are not the ones trained)"),
    )


def _finish(report: dict[str, Any], checks: list[dict[str, Any]], started: float) -> dict[str, Any]:
    report["checks"] = checks
    report["verdict"] = "PASS" if checks and all(c["passed"] for c in checks) else "FAIL"
    report["skipped"] = [c["name"] for c in checks if c.get("skipped")]
    report["seconds"] = round(time.time() - started, 2)
    return report


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(own options, the stage's MaxText arguments)`` of a trainer tool's command line ``OPTION ... -- key=value
    ...`` (the verifier's, the exporter's, :mod:`multislice.trainer.verify_export`'s); no ``--``: no MaxText ones."""
    return (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])


def main(argv: list[str] | None = None) -> int:
    """CLI entry; writes the JSON report to ``--report`` (and stdout). Exit 0 PASS, 1 FAIL, 2 error."""
    argv = sys.argv[1:] if argv is None else argv
    own, maxtext_args = split_args(argv)
    parser = argparse.ArgumentParser(
        prog="python -m multislice.trainer.verify", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--checkpoint-dir", required=True, type=checkpoint_path)
    parser.add_argument("--expected-step", required=True, type=int)
    parser.add_argument("--report", type=Path, help="write the JSON report here too")
    parser.add_argument(
        "--sample-bytes", type=int, default=DEFAULT_SAMPLE_BYTES, help="restore chunk and sample size, bytes"
    )
    parser.add_argument(
        "--full-check-bytes", type=int, default=FULL_CHECK_BYTES, help="check every array up to this size, bytes"
    )
    parser.add_argument(
        "--metrics-file", type=checkpoint_path, help="the stage's metrics.jsonl (default: next to the checkpoints)"
    )
    parser.add_argument("--loss-rtol", type=float, default=LOSS_RTOL, help="relative tolerance of the loss replay")
    parser.add_argument(
        "--loss-check-flops", type=float, default=LOSS_CHECK_FLOPS, help="skip the loss checks above this, FLOPs"
    )
    options = parser.parse_args(own)
    if not maxtext_args:
        parser.error("give the stage's MaxText arguments after --, so the expected model can be built")
    # Standard output carries the report alone: what MaxText prints while it is imported and builds the model
    # (e.g. its goodput stub's "[NO-OP] ml_goodput_measurement ..." line under lean_imports) goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        lean_imports.install(maxtext_args)  # before MaxText is imported: no torch, transformers... for the model
        report, status = run(
            options.checkpoint_dir, options.expected_step, maxtext_args, options.metrics_file, options.sample_bytes,
            options.full_check_bytes, options.loss_rtol, options.loss_check_flops,
        )  # fmt: skip
    emit_report(report, options.report)
    return status


def warm_up(argv: list[str]) -> None:
    """Do the verifier's imports ahead of its run, in a tool started while the stage trains
    (:mod:`multislice.trainer.warm`): :func:`multislice.trainer.lean_imports.install` for the stage's MaxText
    arguments (those after ``--`` in ``argv``), then JAX, Orbax, Flax and MaxText's model code, which building the
    expected model imports (about 8 s of a stage's verification on this machine). Reads nothing of the checkpoint."""
    _, maxtext_args = split_args(argv)
    with contextlib.redirect_stdout(sys.stderr):
        lean_imports.install(maxtext_args)
        import jax  # noqa: F401 (imported ahead: this function's whole point)
        import orbax.checkpoint  # noqa: F401 (imported ahead)
        from flax import linen  # noqa: F401 (imported ahead)
        from maxtext.utils import maxtext_utils, model_creation_utils  # noqa: F401 (imported ahead)


def run(
    checkpoint_dir: Any,
    expected_step: int,
    maxtext_args: list[str],
    metrics_file: Any = None,
    sample_bytes: int = DEFAULT_SAMPLE_BYTES,
    full_check_bytes: int = FULL_CHECK_BYTES,
    loss_rtol: float = LOSS_RTOL,
    loss_flops: float = LOSS_CHECK_FLOPS,
) -> tuple[dict[str, Any], int]:
    """:func:`verify` with its failure as a report: ``(report, exit status)``, 0 PASS, 1 FAIL, 2 ERROR.

    ``checkpoint_dir``: an ``etils.epath.Path`` (:func:`checkpoint_path`); ``metrics_file`` (None: the
    ``metrics.jsonl`` beside it). ERROR: the verifier itself could not run (the exception's type and message in
    ``error``). Used by :func:`main` and by :mod:`multislice.trainer.verify_export`. The report's
    ``heavy_imports``: which of :data:`multislice.trainer.lean_imports.HEAVY` this process has imported (none of
    torch and transformers when the entry point installed :func:`multislice.trainer.lean_imports.install` first).
    """
    try:
        report = verify(
            checkpoint_dir, expected_step, maxtext_args, sample_bytes, full_check_bytes,
            metrics_file or checkpoint_dir.parent / "metrics.jsonl", loss_rtol, loss_flops,
        )  # fmt: skip
        report["heavy_imports"] = lean_imports.loaded()  # of lean_imports.HEAVY: what building the model pulled in
        return report, 0 if report["verdict"] == "PASS" else 1
    except Exception as error:  # the report must say why the verifier could not run
        return {
            "verdict": "ERROR",
            "error": f"{type(error).__name__}: {error}",
            "checkpoint_dir": str(checkpoint_dir),
        }, 2


def emit_report(report: dict[str, Any], path: Path | None) -> None:
    """Print ``report`` as JSON (what :func:`parse_report` reads back) and write it to ``path`` too, if given."""
    text = json.dumps(report, indent=1)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
