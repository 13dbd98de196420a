"""A stand-in trainer pod for ``tests/trainer/test_compile_cache.py``: what the worker does before MaxText's train
step compiles, then one compile of a program sharded over every process's devices.

Run in the trainer environment with a trainer pod's environment (the rendered JobSet's, :func:`expand_jobset`)::

    python -m tests.trainer.compile_cache_pod CACHE_DIR OPS

It joins ``jax.distributed`` as :mod:`multislice.trainer.worker` does (:func:`initialize_cpu_distributed`, the
pod's ``JAX_COORDINATOR_ADDRESS``/``PORT``), reports compiles and writes cache entries from every process
(:mod:`multislice.trainer.compile_cache`), sets the persistent cache directory as MaxText does with
``jax_cache_dir`` (``maxtext/configs/pyconfig.py``: ``compilation_cache.set_cache_dir``; JAX's other cache settings
left at their defaults, as MaxText leaves them), and compiles a jitted program of ``OPS`` layers over a mesh of all
devices (the worker's ``XLA compile of F: N s (compiled|cache hit)`` line says which it was).
"""

from __future__ import annotations

import sys

from multislice.trainer import compile_cache, worker


def main() -> None:
    cache_dir, ops = sys.argv[1], int(sys.argv[2])
    import jax
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    worker.initialize_cpu_distributed(120)
    compile_cache.report_compiles()
    compile_cache.write_from_every_process()
    compilation_cache.set_cache_dir(cache_dir)

    def program(x):
        for i in range(ops):
            x = jnp.tanh(x @ x.T + i) * 0.5 + jnp.sin(x)
        return x.sum()

    mesh = Mesh(jax.devices(), ("data",))
    sharded = NamedSharding(mesh, PartitionSpec("data"))
    shape = jax.ShapeDtypeStruct((8 * jax.device_count(), 8 * jax.device_count()), jnp.float32, sharding=sharded)
    jax.jit(program).lower(shape).compile()
    print(f"process {jax.process_index()} of {jax.process_count()}: {jax.device_count()} devices", flush=True)


if __name__ == "__main__":
    main()
