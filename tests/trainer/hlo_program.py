"""A small real program compiled for 2 x v6e-16 (libtpu's topology description; no TPU): its HLO and costs.

Run in the trainer environment: ``python -m tests.trainer.hlo_program OUT.hlo`` writes the optimized HLO
to ``OUT.hlo`` and prints ``{"cost_analysis": ..., "slice_of": [...], "summary": ...}`` as JSON.

The program is the gradient of a 4-layer ``lax.scan`` of ``tanh(h @ w)`` with the weights FSDP-sharded
over both slices (``w``: 4 x 1024 x 1024 bf16, ``x``: 256 x 1024 bf16, both split 32 ways): per device
the step runs 12 matmuls of 2 x 8 x 1024 x 1024 FLOPs (forward 4, backward 8), all-gathers each layer's
weights and reduce-scatters its gradient, over ICI within a slice and over DCN across the two.
``tests/data/hlo/scan_grad_v6e-16x2.hlo`` is this program's HLO as libtpu 0.0.52 compiled it.
"""

import json
import os
import sys

LAYERS, WIDTH, BATCH = 4, 1024, 256
#: Matmul FLOPs per device per step: 3 matmuls per layer (forward, and two in the backward pass).
EXPECTED_FLOPS = 3 * LAYERS * 2 * (BATCH // 32) * WIDTH * WIDTH


def main(out: str) -> None:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental.topologies import get_topology_desc
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from multislice.trainer import hlo_cost

    topology = get_topology_desc(platform="tpu", topology_name="v6e:4x4", chips_per_host_bounds=(2, 2, 1), num_slices=2)
    mesh = Mesh(np.array(topology.devices).reshape(2, 16), ("dcn", "ici"))

    def loss(w, x):
        def layer(h, wl):
            return jnp.tanh(h @ wl), None

        h, _ = jax.lax.scan(layer, x, w)
        return jnp.sum(h)

    weights = NamedSharding(mesh, P(None, ("dcn", "ici"), None))
    step = jax.jit(jax.grad(loss), in_shardings=(weights, NamedSharding(mesh, P(("dcn", "ici"), None))),
                   out_shardings=weights)  # fmt: skip
    compiled = step.lower(
        jax.ShapeDtypeStruct((LAYERS, WIDTH, WIDTH), jnp.bfloat16), jax.ShapeDtypeStruct((BATCH, WIDTH), jnp.bfloat16)
    ).compile()
    text = compiled.as_text()
    with open(out, "w", encoding="utf-8") as handle:
        handle.write(text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    slice_of = [int(d.slice_index) for d in mesh.devices.flat]
    summary = hlo_cost.summarize(text, cost, slice_of, 2)
    keep = {k: float(v) for k, v in cost.items() if k in ("flops", "bytes accessed")}
    print(json.dumps({"cost_analysis": keep, "slice_of": slice_of, "summary": summary}))


if __name__ == "__main__":
    main(sys.argv[1])
