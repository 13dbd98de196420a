"""Preflight: prove each stage fits in HBM by AOT-compiling it for the target TPU topology.

config -> plan -> **preflight** -> provision: nothing is provisioned until every
stage compiles for ``num_slices`` x ``tpu_type`` within the HBM XLA allows per
chip. The compiles run in the trainer environment
(:mod:`multislice.trainer.aot`, MaxText's own ``train_compile`` path with
libtpu's topology description; no TPU is needed) through an :class:`AotSession`:
one trainer process answers a stream of requests, so MaxText and JAX are
imported once however many configs the planner tries. Verdicts are cached on
disk (``PreflightSpec.cache_dir``), keyed by MaxText, libtpu and JAX versions
and a hash of the compile-relevant arguments, so a rerun recompiles nothing.

Each stage's report (:func:`stage_report`) states its units: bytes per chip,
with GiB (2**30 bytes; XLA's ``G``) for reading.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multislice.backends.local import trainer_env, trainer_process_env
from multislice.plan import Plan, StagePlan

GIB = 1024**3
#: A generous bound on one compile of a 70B-class model on 2 cores (measured: 12-230 s).
COMPILE_TIMEOUT_SECONDS = 1200
AOT_MODULE = "multislice.trainer.aot"
RESULT_PREFIX = "AOT_RESULT "


class PreflightError(RuntimeError):
    """The AOT compile could not run or gave no verdict (not a does-not-fit); the message says why."""


class CompileTimeout(PreflightError):
    """An AOT compile ran past its time limit and was stopped (the session restarts for the next one)."""


class PreflightFailed(RuntimeError):
    """A stage does not fit in HBM (or MaxText rejected its config); nothing was provisioned.

    ``reports`` holds every stage's report; the message gives the per-chip
    numbers and the nearest fitting alternative when one was found.
    """

    def __init__(self, message: str, reports: list[dict[str, Any]]):
        super().__init__(message)
        self.reports = reports


def gib(value: float | None) -> str:
    """Bytes as ``12.34 GiB``, or ``56.7 MiB`` below 1 GiB (None as ``?``)."""
    if value is None:
        return "?"
    return f"{value / GIB:.2f} GiB" if abs(value) >= GIB else f"{value / 2**20:.1f} MiB"


def default_cache_dir(plan: Plan) -> str:
    """The verdict cache of a plan: ``preflight.cache_dir``, else ``<output_dir>/preflight-cache`` (shared by runs)."""
    return plan.spec.preflight.cache_dir or f"{plan.spec.output_dir.rstrip('/')}/preflight-cache"


def user_cache_dir() -> str:
    """The CLI's verdict cache on this machine: ``$XDG_CACHE_HOME/multislice-pipelines/preflight``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "multislice-pipelines" / "preflight")


def request_for(plan: Plan, stage: StagePlan) -> dict[str, Any]:
    """The AOT request of one stage: its MaxText arguments for ``num_slices`` x the slice's topology."""
    return {
        "name": stage.name,
        "compile_topology": plan.spec.slice_type.maxtext_topology,
        "num_slices": plan.spec.num_slices,
        "maxtext_args": list(stage.maxtext_args),
    }


class AotSession:
    """A trainer-environment process that AOT-compiles requests one at a time.

    Use as a context manager. :meth:`compile` sends one request and waits for
    its result (a dict, see :mod:`multislice.trainer.aot`); the process starts
    with the first request and ends when the context does.

    Args:
        cache_dir: Verdict cache (path or ``gs://``), or None for no cache.
        work_dir: Where the process's results file and MaxText scratch go.
        env_dir: The trainer environment (default :func:`trainer_env`).

    Raises:
        multislice.backends.local.TrainerEnvMissing: no trainer environment.
    """

    def __init__(self, cache_dir: str | None, work_dir: str | Path, env_dir: Path | None = None):
        self.env_dir = env_dir or trainer_env()
        self.work_dir = Path(work_dir)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.results = self.work_dir / "aot-results.jsonl"
        self.log = self.work_dir / "aot.log"
        self.cache_dir = cache_dir
        self.process: subprocess.Popen | None = None
        self._read = 0

    def __enter__(self) -> AotSession:
        return self  # the trainer process starts with the first compile: a search that prunes everything starts none

    def _start(self) -> None:
        self.results.unlink(missing_ok=True)
        self._read = 0
        command = [str(self.env_dir / "bin" / "python"), "-m", AOT_MODULE, "--results", str(self.results)]
        command += ["--scratch", str(self.work_dir / "scratch")]
        if self.cache_dir:
            command += ["--cache-dir", self.cache_dir]
        env = trainer_process_env(self.env_dir)
        env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env, text=True
            )

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the trainer process (its stdin closes; it exits after the current request)."""
        if self.process and self.process.poll() is None:
            try:
                self.process.stdin.close()
                self.process.wait(timeout=30)
            except (subprocess.TimeoutExpired, OSError):
                self.process.kill()
                self.process.wait()
        self.process = None

    def compile(self, request: dict[str, Any], timeout: float = COMPILE_TIMEOUT_SECONDS) -> dict[str, Any]:
        """Send one request and wait for its result.

        Raises:
            CompileTimeout: no result within ``timeout`` seconds; the process was stopped, and
                the next call starts a new one.
            PreflightError: the trainer process died.
        """
        if self.process is None:
            self._start()
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.results.read_text(encoding="utf-8").splitlines() if self.results.exists() else []
            if len(lines) > self._read:
                self._read += 1
                return json.loads(lines[self._read - 1])
            if self.process.poll() is not None:
                raise PreflightError(
                    f"the AOT compile process exited with status {self.process.returncode} before answering "
                    f"{request.get('name')!r}; its log ({self.log}) ends:\n{_tail(self.log)}"
                )
            time.sleep(0.2)
        self.process.kill()
        self.process.wait()
        self.process = None
        raise CompileTimeout(f"no AOT verdict for {request.get('name')!r} within {timeout:.0f} s; log: {self.log}")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def cost_estimate(plan: Plan, stage: StagePlan, result: dict[str, Any]) -> dict[str, Any] | None:
    """Chip-hours and price of the stage's steps, from MaxText's model FLOPs per step per chip.

    step seconds = model TFLOP per step per chip x 1e12 / (peak bf16 FLOP/s per chip x assumed MFU);
    chip-hours = steps x step seconds x chips / 3600; cost = chip-hours x ``cost.price_per_chip_hour``.
    Returns None when the compile gave no FLOP count.
    """
    tflops = result.get("model_tflops_per_step_per_device")
    if not tflops:
        return None
    cost = plan.spec.cost
    peak = plan.spec.slice_type.peak_bf16_flops_per_chip
    step_seconds = tflops * 1e12 / (peak * cost.assumed_mfu)
    chip_hours = stage.steps * step_seconds * plan.total_chips / 3600
    return {
        "assumed_mfu": cost.assumed_mfu,
        "peak_bf16_flops_per_chip": peak,
        "estimated_step_seconds": round(step_seconds, 3),
        "steps": stage.steps,
        "chips": plan.total_chips,
        "chip_hours": float(f"{chip_hours:.4g}"),
        "price_per_chip_hour": cost.price_per_chip_hour,
        "currency": cost.currency,
        "price_source": cost.price_source,
        "estimated_cost": float(f"{chip_hours * cost.price_per_chip_hour:.4g}"),
    }


def stage_report(plan: Plan, stage: StagePlan, result: dict[str, Any]) -> dict[str, Any]:
    """The preflight report of one stage from its AOT result.

    Keys: ``stage``, ``verdict`` (``fits``, ``does_not_fit``, ``error``),
    ``target`` (topology, slices, chips), ``units`` (``bytes per chip``),
    ``hbm_bytes_per_chip`` (what XLA lets a program use), ``bytes_per_chip``
    (argument, output, alias, temp, generated_code, host_* and total, when it
    fits), ``required_bytes_per_chip`` (the compiler's figure, when it does
    not), ``headroom_bytes_per_chip`` (negative when it does not fit),
    ``compile_seconds``, ``cached``, ``model_tflops_per_step_per_device``,
    ``tokens_per_step_per_device``, ``cost``, ``maxtext_args``, ``error``.
    """
    shape = plan.spec.slice_type
    available = shape.usable_hbm_bytes_per_chip
    report: dict[str, Any] = {
        "stage": stage.name,
        "verdict": result.get("verdict", "error"),
        "target": {
            "tpu_type": shape.name,
            "compile_topology": shape.maxtext_topology,
            "num_slices": plan.spec.num_slices,
            "chips": plan.total_chips,
        },
        "units": "bytes per chip (GiB = 2**30 bytes; XLA's 'G')",
        "hbm_bytes_per_chip": available,
        "compile_seconds": result.get("compile_seconds"),
        "cached": bool(result.get("cached")),
        "model_tflops_per_step_per_device": result.get("model_tflops_per_step_per_device"),
        "tokens_per_step_per_device": result.get("tokens_per_step_per_device"),
        "mesh": result.get("mesh"),
        "versions": result.get("versions"),
        "maxtext_args": result.get("maxtext_args", list(stage.maxtext_args)),
    }
    if report["verdict"] == "fits":
        memory = result["memory"]
        report["bytes_per_chip"] = memory
        report["headroom_bytes_per_chip"] = available - memory["total"]
    elif report["verdict"] == "does_not_fit":
        oom = result.get("oom", {})
        available = oom.get("available_bytes") or available
        report["hbm_bytes_per_chip"] = available
        report["required_bytes_per_chip"] = oom.get("required_bytes")
        report["headroom_bytes_per_chip"] = (
            available - oom["required_bytes"] if oom.get("required_bytes") is not None else None
        )
        report["compiler_message"] = oom.get("message")
    else:
        report["error"] = result.get("error", "no verdict")
    report["cost"] = cost_estimate(plan, stage, result)
    return report


def summary_line(report: dict[str, Any]) -> str:
    """One line for a stage's report: verdict and per-chip numbers with units."""
    hbm = report["hbm_bytes_per_chip"]
    target = report["target"]
    where = f"{target['num_slices']} x {target['tpu_type']}"
    took = f"{report['compile_seconds']} s"
    took = f"from the cache (first compile {took})" if report["cached"] else took
    if report["verdict"] == "fits":
        b = report["bytes_per_chip"]
        line = (
            f"fits on {where}: {gib(b['total'])} of {gib(hbm)} HBM per chip (arguments {gib(b['argument'])}, "
            f"temporaries {gib(b['temp'])}, outputs {gib(b['output'])}, aliased {gib(b['alias'])}, "
            f"code {gib(b['generated_code'])}"
            + (f", host-offloaded {gib(b['host_argument'] + b['host_temp'])}" if b["host_argument"] else "")
            + f"); headroom {gib(report['headroom_bytes_per_chip'])}; compile {took}"
        )
    elif report["verdict"] == "does_not_fit":
        line = (
            f"does not fit on {where}: needs {gib(report['required_bytes_per_chip'])} per chip, "
            f"{gib(hbm)} available (over by {gib(-(report['headroom_bytes_per_chip'] or 0))}); compile {took}"
        )
    else:
        line = f"no verdict on {where}: {report.get('error', '')[:300]}"
    cost = report.get("cost")
    if cost and report["verdict"] == "fits":
        line += (
            f"; about {cost['chip_hours']:,.3g} chip-hours for {cost['steps']} steps at an assumed "
            f"{cost['assumed_mfu']:.0%} MFU"
            + (f", {cost['estimated_cost']:,.3g} {cost['currency']}" if cost["price_per_chip_hour"] else "")
        )
    return line


def check_stages(
    plan: Plan,
    stages: list[StagePlan],
    session: AotSession,
    on_report: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """AOT-compile each stage in ``session``; returns their reports in order."""
    reports = []
    for stage in stages:
        report = stage_report(plan, stage, session.compile(request_for(plan, stage)))
        reports.append(report)
        if on_report:
            on_report(report)
    return reports


def work_dir_for(plan: Plan) -> Path:
    """Local scratch for the compiles: under the run directory when local, else a temporary directory."""
    if "://" not in plan.run_dir:
        return Path(plan.run_dir) / "preflight"
    return Path(os.environ.get("TMPDIR", "/tmp")) / "multislice-preflight" / plan.spec.run_name
