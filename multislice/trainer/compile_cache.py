"""The run's persistent XLA compilation cache in a training process: every process writes and reads it.

JAX (0.12, ``jax/_src/compiler.py``) looks an executable up in the persistent
cache (``jax_compilation_cache_dir``, which MaxText sets from ``jax_cache_dir``:
``maxtext/configs/pyconfig.py``) under a key that hashes the program, the
compile options, the XLA flags and the *accelerator config*
(``jax/_src/cache_key.py``, ``_hash_accelerator_config``: the fingerprint of
``get_topology_for_devices``), and only process 0 writes entries
(``_cache_write``: "Only write cache entries from the first process", to spare
GCS write contention on one key). On TPU every process has the same topology,
so the others read process 0's entry. On CPU the topology is the process's own
devices (``xla.CpuTopologyProto`` lists only this process's devices): each
process has its own key, the others never find an entry, and after a restart
process 0 loads its program in a second while the others compile for tens of
seconds; JAX's CPU collectives (Gloo) give up waiting after 30 s.

:func:`write_from_every_process` makes each CPU process write its own entry (its
own key, its own file: no contention), so every process of every later attempt
and stage with the same shapes loads. It keeps JAX's own checks
(``jax_persistent_cache_min_compile_time_secs``, and
``jax_persistent_cache_min_entry_size_bytes`` inside ``put_executable_and_time``).

:func:`report_compiles` prints one line per XLA compile that took at least
:data:`REPORTED_SECONDS` and per program loaded from the cache, which the train
step reads from the leader's log (:data:`multislice.metrics.COMPILE_LINE`), e.g.
``multislice worker: XLA compile of jit_train_step: 0.8 s (cache hit)``.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

REPORTED_SECONDS = 1.0
"""Compiles shorter than this are not reported (JAX's default ``jax_persistent_cache_min_compile_time_secs``)."""


_reporting = False


def write_from_every_process() -> None:
    """Let every JAX process on CPU write its own persistent-cache entries (JAX writes from process 0 only).

    Wraps ``jax._src.compiler._cache_write`` (JAX 0.12), which ``_compile_and_write_cache``
    looks up at each call; processes on other platforms, and process 0, keep JAX's own.
    Call before the first compile. Idempotent.
    """
    from jax._src import compilation_cache, compiler, config, distributed

    original = compiler._cache_write
    if getattr(original, "multislice_every_process", False):
        return

    def cache_write(cache_key: str, compile_time_secs: float, module_name: str, backend: Any, executable: Any) -> None:
        if distributed.global_state.process_id == 0 or backend.platform != "cpu":
            return original(cache_key, compile_time_secs, module_name, backend, executable)
        if compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as ex:  # as JAX's own _cache_write: a failed write costs a compile, not the run
            warnings.warn(f"Error writing persistent compilation cache entry for {module_name!r}: {ex}", stacklevel=1)
        return None

    cache_write.multislice_every_process = True  # type: ignore[attr-defined]
    compiler._cache_write = cache_write


def report_compiles(print_line=print) -> None:
    """Print a :data:`multislice.metrics.COMPILE_LINE` for each XLA compile of at least :data:`REPORTED_SECONDS`
    and each program loaded from the persistent cache (only programs that took that long are written there).

    Uses JAX's monitoring events (``jax.monitoring``): ``/jax/compilation_cache/cache_hits``
    marks a load from the persistent cache, ``/jax/core/compile/backend_compile_duration``
    (``jax/_src/dispatch.py``) times each compile or load with the function's name. Idempotent.
    """
    global _reporting
    if _reporting:
        return
    _reporting = True
    import jax.monitoring

    hit = threading.local()

    def on_event(event: str, **_: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            hit.value = True

    def on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
        if event != "/jax/core/compile/backend_compile_duration":
            return
        seconds, fun_name = duration_secs, str(kwargs.get("fun_name", "?"))
        from_cache, hit.value = getattr(hit, "value", False), False
        if seconds >= REPORTED_SECONDS or from_cache:
            source = "cache hit" if from_cache else "compiled"
            print_line(f"multislice worker: XLA compile of {fun_name}: {seconds:.1f} s ({source})", flush=True)

    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)
