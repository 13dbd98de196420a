"""Ahead-of-time compile of MaxText's train step for a TPU topology, on a CPU machine.

Usage (trainer environment: MaxText 0.2.5 with libtpu installed)::

    python -m multislice.trainer.aot [--requests requests.jsonl] [--results results.jsonl] [--cache-dir DIR]

Each request is one line of JSON, ``{"name": ..., "compile_topology": "v6e-16",
"num_slices": 2, "maxtext_args": ["model_name=llama3-70b", ...], "libtpu_flags":
{"xla_tpu_scoped_vmem_limit_kib": "98304", ...}}``, read from
``--requests`` or from stdin as they come (a planner sends the next request
after reading the last result). All are compiled in this one process (MaxText
and JAX are imported once). Each result is printed as one line
``AOT_RESULT {json}`` and appended to ``--results``, as soon as it is known.

The compile is MaxText's own (``maxtext/trainers/pre_train/train_compile.py``):
its topology mesh (``get_topology_mesh``, libtpu's topology description of
``compile_topology`` x ``compile_topology_num_slices``), its shaped train state
and batch (``get_shaped_inputs``), its train step and shardings
(``get_functional_train_with_signature``) and its ``jit_and_compile``. What we add
is the reading of the result:

- fits: XLA's ``CompiledMemoryStats`` of the executable, bytes per chip
  (``argument``, ``output``, ``alias``, ``temp``, ``generated_code``, and the
  ``host_*`` counterparts for what is offloaded to host memory). The per-chip
  HBM total is ``argument + output + temp + generated_code - alias`` (MaxText's
  ``max_utils.print_compiled_memory_stats`` leaves out generated code; we count
  it, as it sits in HBM too);
- does not fit: XLA:TPU raises ``RESOURCE_EXHAUSTED`` (``CompileTimeHbmOom``,
  https://openxla.org/xla/errors/error_1000); :func:`parse_oom` reads the bytes
  required and available from its message, where ``G`` means GiB;
- what a step costs (``step_cost``, fits only): XLA's cost analysis of the executable and the
  collectives of its optimized HLO, per device per step (:mod:`multislice.trainer.hlo_cost`), for
  preflight's step-time estimate (:mod:`multislice.preflight.step_time`); a cached ``fits`` result
  without it is compiled again;
- model FLOPs per step per device from MaxText's own accounting
  (``maxtext_utils.calculate_tflops_training_per_device``; its attention part too, which a Pallas
  attention kernel computes where XLA's cost analysis does not see it), and tokens per step
  per device (``calculate_tokens_training_per_device``).

With ``--cache-dir`` (a local path or ``gs://``), a result is stored under a key
of (MaxText version, libtpu version, JAX version, config hash) and a request
whose key is there is answered from it without importing MaxText, so a rerun
with the same configs takes seconds. The config hash covers the compile
topology, the slice count and the MaxText arguments that shape the compiled
program; it leaves out names, output paths, step counts and checkpoint settings
(:data:`KEY_EXCLUDED_ARGS`), which do not change memory use; and the libtpu flags.

libtpu flags: the process sets ``LIBTPU_INIT_ARGS`` to the request's ``libtpu_flags``
(the TPU pods' value, :mod:`multislice.libtpu_flags`) before its first compile;
libtpu reads it once, so a later request with other flags gets verdict ``error``
(callers start a process per set of flags). libtpu ends the process (status 1,
``ERROR: Unknown command line flag '<name>'``) on a flag it does not know.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

from multislice import storage
from multislice.libtpu_flags import ENV as LIBTPU_ENV
from multislice.libtpu_flags import init_args
from multislice.trainer import hlo_cost

#: MaxText arguments that do not change the compiled train step's memory: left out of the cache key
#: and replaced by local scratch values for the compile.
KEY_EXCLUDED_ARGS = frozenset(
    {
        "run_name", "base_output_directory", "jax_cache_dir", "steps", "checkpoint_period",
        "enable_checkpointing", "async_checkpointing", "metrics_file", "hardware", "num_slices",
        "skip_jax_distributed_system", "compile_topology", "compile_topology_num_slices",
    }
)  # fmt: skip

#: Versions that make up the cache key, with the package each is read from.
VERSIONED_PACKAGES = ("maxtext", "libtpu", "jax")

_SIZE = re.compile(r"(?P<value>[0-9]+(?:\.[0-9]+)?)\s*(?P<unit>[KMGT]i?B?|B)\b")
_UNITS = {"B": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def size_to_bytes(text: str) -> int:
    """``49.82G`` -> bytes. XLA prints sizes with binary units: ``G`` is GiB, ``M`` MiB, ``K`` KiB."""
    match = _SIZE.fullmatch(text.strip())
    if not match:
        raise ValueError(f"not an XLA size: {text!r}")
    return round(float(match.group("value")) * _UNITS[match.group("unit")[0]])


_OOM_PATTERNS = (
    # XLA:TPU E1000 CompileTimeHbmOom (libtpu 0.0.51): "the total memory required for HLO
    # temporaries (49.82G) exceeds available HBM (31.24G)".
    re.compile(
        r"required for (?P<what>[\w ]+?) \((?P<required>[0-9.]+[KMGT]?B?)\) "
        r"exceeds available HBM \((?P<available>[0-9.]+[KMGT]?B?)\)"
    ),
    # Older wording: "Ran out of memory in memory space hbm. Used 49.80G of 31.25G hbm."
    re.compile(r"Used (?P<required>[0-9.]+[KMGT]?B?) of (?P<available>[0-9.]+[KMGT]?B?) hbm"),
)  # fmt: skip


def parse_oom(message: str) -> dict[str, Any] | None:
    """Read an XLA:TPU out-of-HBM compile error.

    Args:
        message: The exception text of the failed compile.

    Returns:
        ``{"required_bytes", "available_bytes", "what", "message"}`` (bytes per
        chip), or None when the message is not an out-of-HBM error.
    """
    if "RESOURCE_EXHAUSTED" not in message and "HbmOom" not in message:
        return None
    first = next((line for line in message.splitlines() if "RESOURCE_EXHAUSTED" in line or "HbmOom" in line), "")
    for pattern in _OOM_PATTERNS:
        match = pattern.search(message)
        if match:
            return {
                "required_bytes": size_to_bytes(match.group("required")),
                "available_bytes": size_to_bytes(match.group("available")),
                "what": (match.groupdict().get("what") or "program").strip(),
                "message": first.strip()[:500],
            }
    return {"required_bytes": None, "available_bytes": None, "what": "", "message": first.strip()[:500]}


def memory_from_stats(stats: Any) -> dict[str, int]:
    """Bytes per chip from XLA's ``CompiledMemoryStats`` (``compiled.memory_analysis()``).

    Returns keys ``argument``, ``output``, ``alias``, ``temp``, ``generated_code``,
    ``host_argument``, ``host_output``, ``host_alias``, ``host_temp``,
    ``host_generated_code`` and ``total`` (HBM: argument + output + temp +
    generated_code - alias), all bytes per chip.
    """
    fields = ("argument", "output", "alias", "temp", "generated_code")
    out = {f: int(getattr(stats, f"{f}_size_in_bytes", 0) or 0) for f in fields}
    for f in fields:
        out[f"host_{f}"] = int(getattr(stats, f"host_{f}_size_in_bytes", 0) or 0)
    out["total"] = out["argument"] + out["output"] + out["temp"] + out["generated_code"] - out["alias"]
    return out


def versions() -> dict[str, str]:
    """Installed versions of the packages in the cache key (``missing`` when absent)."""
    found = {}
    for package in VERSIONED_PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "missing"
    return found


def split_args(maxtext_args: list[str]) -> dict[str, str]:
    """``["k=v", ...]`` -> ``{k: v}`` (the last value of a key wins, as in MaxText)."""
    out = {}
    for arg in maxtext_args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"MaxText arguments must be key=value, got {arg!r}")
        out[key] = value
    return out


def cache_key(
    compile_topology: str,
    num_slices: int,
    maxtext_args: list[str],
    found: dict[str, str],
    libtpu_flags: dict[str, str] | None = None,
) -> str:
    """Hex SHA-256 of (versions, topology, slices, the compile-relevant MaxText arguments, libtpu flags).

    The libtpu flags enter the key only when there are some, so a request without flags keeps its key.
    """
    args = {k: v for k, v in split_args(maxtext_args).items() if k not in KEY_EXCLUDED_ARGS}
    payload = {"versions": found, "topology": compile_topology, "num_slices": num_slices, "args": sorted(args.items())}
    if libtpu_flags:
        payload["libtpu_flags"] = list(libtpu_flags.items())  # in order: a later repeat of a flag wins in libtpu
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cache_read(cache_dir: str, key: str) -> dict[str, Any] | None:
    """The cached result for ``key`` (local or ``gs://`` cache), or None."""
    try:
        return storage.read_json(storage.join(cache_dir, f"{key}.json"))
    except (OSError, ValueError):
        return None


def cache_write(cache_dir: str, key: str, result: dict[str, Any]) -> None:
    """Store a result (a reader that meets a half-written entry takes it as a miss)."""
    storage.write_text(storage.join(cache_dir, f"{key}.json"), json.dumps(result, indent=1))


def compile_args(maxtext_args: list[str], compile_topology: str, num_slices: int, scratch: str) -> list[str]:
    """The MaxText arguments of the compile: the stage's, with local scratch paths and the target topology."""
    args = {k: v for k, v in split_args(maxtext_args).items() if k not in KEY_EXCLUDED_ARGS}
    args.update(
        run_name="preflight",
        base_output_directory=scratch,
        enable_checkpointing="false",
        compile_topology=compile_topology,
        compile_topology_num_slices=str(num_slices),
    )
    return [f"{k}={v}" for k, v in args.items()]


#: The libtpu flags this process was prepared with (None before the first compile): libtpu reads
#: ``LIBTPU_INIT_ARGS`` once, when it initialises, so one process compiles with one set of flags.
_prepared: dict[str, str] | None = None

#: What MaxText's ``train_compile.main`` appends to ``LIBTPU_INIT_ARGS`` (and its ``train.main`` too).
MAXTEXT_LIBTPU_FLAG = "--xla_tpu_spmd_rng_bit_generator_unsafe=true"


class FlagsMismatch(RuntimeError):
    """A request's libtpu flags differ from those this process's libtpu was initialised with."""


def flags_mismatch(flags: dict[str, str]) -> str | None:
    """Why this process cannot compile with ``flags`` (its libtpu was initialised with others), or None."""
    if _prepared is None or _prepared == flags:
        return None
    return (
        f"this compile process's libtpu was initialised with LIBTPU_INIT_ARGS={init_args(_prepared)!r}, "
        f"the request asks for {init_args(flags)!r}: compile it in a new process"
    )


def _prepare(flags: dict[str, str]) -> None:
    """What MaxText's ``train_compile.main`` sets before its first compile, with the request's libtpu flags.

    ``LIBTPU_INIT_ARGS`` becomes the request's flags (:func:`multislice.libtpu_flags.init_args`, the
    same value the TPU pods get) plus MaxText's own flag; libtpu reads it when the first compile
    initialises it, once per process.

    Raises:
        FlagsMismatch: a request after the first asks for other flags (the caller starts a new process).
    """
    global _prepared
    problem = flags_mismatch(flags)
    if problem:
        raise FlagsMismatch(problem)
    if _prepared is not None:
        return
    # libtpu takes /tmp/libtpu_lockfile unless told that several processes may load it; an AOT
    # compile uses no TPU, so two compiles on one machine (two pipeline runs) must not exclude each other.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    os.environ[LIBTPU_ENV] = " ".join(filter(None, (init_args(flags), MAXTEXT_LIBTPU_FLAG)))
    _prepared = dict(flags)


def compile_one(request: dict[str, Any], scratch: str) -> dict[str, Any]:
    """AOT-compile one request with MaxText; returns the result (see the module docstring).

    Never raises for a config problem: an out-of-HBM compile is verdict
    ``does_not_fit``; any other failure (a bad argument MaxText rejects, an
    unsupported topology, libtpu flags other than this process's) is verdict
    ``error`` with the exception text.
    """
    topology, slices = request["compile_topology"], int(request["num_slices"])
    flags = dict(request.get("libtpu_flags") or {})
    problem = flags_mismatch(flags)
    if problem:
        return {"name": request.get("name"), "compile_topology": topology, "num_slices": slices,
                "verdict": "error", "error": f"FlagsMismatch: {problem}"}  # fmt: skip
    import jax
    from flax.core.spmd import logical_axis_rules as axis_rules
    from maxtext import configs
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    _prepare(flags)
    args = compile_args(request["maxtext_args"], topology, slices, scratch)
    base_yml = str(Path(configs.__file__).with_name("base.yml"))
    seconds: dict[str, float] = {}
    result: dict[str, Any] = {"name": request.get("name"), "compile_topology": topology, "num_slices": slices}
    started = time.monotonic()
    try:
        config = pyconfig.initialize(["train_compile", base_yml, *args])
        train_compile.validate_config(config)
        mesh = train_compile.get_topology_mesh(config)
        seconds["setup"] = time.monotonic() - started
        total, learnable, attention = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
        result["model_tflops_per_step_per_device"] = float(total)
        result["attention_tflops_per_step_per_device"] = float(attention)
        result["tokens_per_step_per_device"] = float(maxtext_utils.calculate_tokens_training_per_device(config))
        result["devices"] = int(mesh.devices.size)
        result["mesh"] = dict(zip(config.mesh_axes, (int(d) for d in mesh.devices.shape), strict=True))
        shaped_args, shaped_kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
        params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
        input_shardings = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
        data_sharding = sharding.get_input_data_sharding(config, mesh)
        func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
            train.train_step, data_sharding, input_shardings, model, config, params_shardings
        )
        seconds["shapes"] = time.monotonic() - started - seconds["setup"]
        compile_started = time.monotonic()
        try:
            compiled = train_compile.jit_and_compile(
                func, shaped_args, shaped_kwargs, mesh, in_shard, out_shard, static, donate, config,
                axis_rules(config.logical_axis_rules),
            )  # fmt: skip
        except jax.errors.JaxRuntimeError as error:
            seconds["compile"] = time.monotonic() - compile_started
            oom = parse_oom(str(error))
            if oom is None:
                raise
            result.update(verdict="does_not_fit", oom=oom)
        else:
            seconds["compile"] = time.monotonic() - compile_started
            result.update(verdict="fits", memory=memory_from_stats(compiled.memory_analysis()))
            read_started = time.monotonic()
            result["step_cost"] = step_cost(compiled, mesh, request.get("name"))
            seconds["cost"] = time.monotonic() - read_started
    except Exception as error:  # noqa: BLE001 - reported as the request's verdict
        result.update(
            verdict="error",
            error=f"{type(error).__name__}: {error}"[:2000],
            traceback=traceback.format_exc()[-3000:],
        )
    result["seconds"] = {k: round(v, 1) for k, v in seconds.items()}
    result["compile_seconds"] = round(time.monotonic() - started, 1)
    result["maxtext_args"] = args
    result["libtpu_init_args"] = os.environ.get(LIBTPU_ENV, "")
    return result


#: A directory to write each compiled program's HLO and cost analysis to (``<name>.hlo``, ``<name>.json``).
HLO_DIR_ENV = "MULTISLICE_AOT_HLO_DIR"


def step_cost(compiled: Any, mesh: Any, name: str | None = None) -> dict[str, Any] | None:
    """The compiled step's cost summary (:func:`multislice.trainer.hlo_cost.summarize`), or None if unreadable.

    Reads XLA's ``cost_analysis()`` and the optimized HLO (``as_text()``) of the executable, and the
    slice of each of the program's devices (``slice_index`` of the topology mesh's devices, flattened in
    the mesh's order: the program's logical device ids), so that a collective over two slices counts as DCN.
    With ``$MULTISLICE_AOT_HLO_DIR`` set, the HLO and cost analysis are also written there, named after ``name``.
    """
    try:
        slice_of = [int(getattr(d, "slice_index", 0) or 0) for d in mesh.devices.flat]
        text, cost = compiled.as_text(), compiled.cost_analysis()
        keep = os.environ.get(HLO_DIR_ENV)
        if keep:  # benchmarks/step_time.py keeps each program to re-read it without compiling again
            base = str(Path(keep) / re.sub(r"[^A-Za-z0-9_.-]+", "_", name or "program"))
            Path(base + ".hlo").write_text(text)
            first = cost[0] if isinstance(cost, list) else cost
            Path(base + ".json").write_text(json.dumps({"cost": first, "slice_of": slice_of}, default=float))
        return hlo_cost.summarize(text, cost, slice_of, len(set(slice_of)))
    except Exception as error:  # noqa: BLE001 - the estimate is optional; the verdict stands without it
        return {"error": f"{type(error).__name__}: {error}"[:500]}


#: Prefix of the line each result is also printed on (stdout), so that a caller reading
#: only the pod's log (a Kubernetes Job) gets the results too.
RESULT_PREFIX = "AOT_RESULT "


def answer(request: dict[str, Any], cache_dir: str | None, scratch: str, found: dict[str, str]) -> dict[str, Any]:
    """One request's result: from the cache when its key is there, else by compiling (then cached)."""
    key = cache_key(
        request["compile_topology"], int(request["num_slices"]), request["maxtext_args"], found,
        request.get("libtpu_flags"),
    )  # fmt: skip
    result = cache_read(cache_dir, key) if cache_dir else None
    if result is not None and result.get("verdict") == "fits" and "step_cost" not in result:
        result = None  # cached before the step-cost summary existed: compile again to get it
    if result is not None:
        return {**result, "name": request.get("name"), "cached": True}
    result = {**compile_one(request, scratch), "key": key, "versions": found, "cached": False}
    if cache_dir and result["verdict"] in ("fits", "does_not_fit"):
        cache_write(cache_dir, key, result)
    return result


def main(argv: list[str] | None = None) -> int:
    """Answer requests, one JSON object per line, from ``--requests`` or stdin until end of input."""
    parser = argparse.ArgumentParser(
        prog="python -m multislice.trainer.aot", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--requests", help="JSON-lines file of requests (default: read them from stdin)")
    parser.add_argument("--request-json", help="one request as JSON (a Kubernetes Job's argument), instead of stdin")
    parser.add_argument("--results", help="JSON-lines file each result is appended to")
    parser.add_argument("--cache-dir", help="verdict cache directory (local path or gs://)")
    parser.add_argument("--scratch", default="/tmp/multislice-aot", help="scratch directory for MaxText")
    options = parser.parse_args(argv)
    found = versions()
    if options.request_json:
        source = [options.request_json]
    else:
        source = open(options.requests, encoding="utf-8") if options.requests else sys.stdin
    out = None
    if options.results:
        Path(options.results).parent.mkdir(parents=True, exist_ok=True)
        out = open(options.results, "a", encoding="utf-8")
    try:
        for line in source:
            if not line.strip():
                continue
            result = answer(json.loads(line), options.cache_dir, options.scratch, found)
            text = json.dumps(result)
            print(RESULT_PREFIX + text, flush=True)
            if out:
                out.write(text + "\n")
                out.flush()
    finally:
        if out:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
