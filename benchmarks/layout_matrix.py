"""One dense layer's forward and backward under every pair of input layouts: the cost model's
figures for XLA's layout against what XLA compiles.

The program is ``jax.grad(sum(tanh(einsum('bsh,hd->bsd', h, k))), argnums=(0, 1))`` with ``h``
(8, 16, 128) and ``k`` (128, 32); ``h`` takes 7 specs and ``k`` 8 over a ``data`` x ``model``
mesh of 8 simulated CPU devices (56 rows), the gradients their inputs' specs. Each row compares
the estimate of :func:`automap.xla_layout.xla_layout` (automap's model of the layout XLA's
partitioner picks for the intermediates, given only the inputs' and outputs' specs) with
``jax.jit(fn, in_shardings=..., out_shardings=...)`` compiled: bytes sent per device (ring
traffic, ``wire_bytes`` on both sides) and memory per device, targets within 10% and 25% as
``benchmarks/fidelity.py`` holds them. No automap plan and no search is involved: the matrix
tests the layout and collective model alone, on every way a user could lay out one layer.

    python benchmarks/layout_matrix.py [--mesh 2x4] [--limit N]

It prints one line per pair and a summary (rows outside each target, the worst ratios).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import automap  # noqa: E402
from automap.cost.estimate import estimate  # noqa: E402
from automap.ir.lower import lower  # noqa: E402
from automap.shardings import ShardingState, from_partition_spec  # noqa: E402
from automap.xla_layout import xla_layout  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fidelity import _ratio, mesh_arg  # noqa: E402  (the same ratio and --mesh as the fidelity benchmark)

BYTES_TOL, MEMORY_TOL = 0.10, 0.25  # as benchmarks/fidelity.py (automap.verify.TOLERANCES)
D, M, DM = "data", "model", ("data", "model")
H_SPECS = [P(M, None, D), P(D, None, M), P(M, None, None), P(D, None, None), P(DM, None, None), P(None, None, M),
           P(None, None, D)]
K_SPECS = [P(D, M), P(M, D), P(D, None), P(None, D), P(M, None), P(None, M), P(DM, None), P(None, DM)]


def _loss(h, k):
    return jnp.sum(jnp.tanh(jnp.einsum("bsh,hd->bsd", h, k)))


GRAD = jax.grad(_loss, argnums=(0, 1))
SHAPES = ((8, 16, 128), (128, 32))


def row(h_spec: P, k_spec: P, axes: dict[str, int]) -> dict:
    """The estimate against XLA for one pair of specs: bytes sent and memory per device, each side."""
    h, k = (jnp.ones(s, jnp.float32) for s in SHAPES)
    program = lower(jax.make_jaxpr(GRAD)(h, k), ["h", "k"], ["dh", "dk"])
    ins = (h_spec, k_spec)
    specs = {v: from_partition_spec(s, len(program.values[v].shape))
             for v, s in zip(program.inputs + program.outputs, ins + ins, strict=True)}
    state = ShardingState.initial(program, axes).replace(specs=specs, frozen=frozenset(specs))
    est = estimate(xla_layout(state))
    mesh = automap.make_mesh(axes)
    shardings = tuple(NamedSharding(mesh, s) for s in ins)
    xla = automap.measure(jax.jit(GRAD, in_shardings=shardings, out_shardings=shardings).lower(h, k).compile())
    return dict(h=h_spec, k=k_spec, est_bytes=est.wire_bytes, xla_bytes=xla.wire_bytes,
                est_memory=est.peak_memory_bytes, xla_memory=xla.memory_per_device,
                bytes=_ratio(est.wire_bytes, xla.wire_bytes), memory=_ratio(est.peak_memory_bytes, xla.memory_per_device))


def summary(rows: list[dict]) -> list[str]:
    """Rows outside each target and the worst ratio on each side of 1."""
    lines = []
    for fig, tol in (("bytes", BYTES_TOL), ("memory", MEMORY_TOL)):
        out = [r for r in rows if abs(r[fig] - 1) > tol]
        lo, hi = min(r[fig] for r in rows), max(r[fig] for r in rows)
        lines.append(f"{fig}: {len(out)} of {len(rows)} outside {tol:.0%} (est/XLA from {lo:.2f} to {hi:.2f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mesh", default="2x4", help="DATAxMODEL, 8 devices in all (default 2x4)")
    parser.add_argument("--limit", type=int, help="only the first N pairs")
    args = parser.parse_args(argv)
    axes = mesh_arg(args.mesh)
    pairs = list(itertools.product(H_SPECS, K_SPECS))[: args.limit]
    t0, rows = time.time(), []
    for h_spec, k_spec in pairs:
        r = row(h_spec, k_spec, axes)
        rows.append(r)
        flag = " <<<" if abs(r["bytes"] - 1) > BYTES_TOL or abs(r["memory"] - 1) > MEMORY_TOL else ""
        print(f"h={str(h_spec):28s} k={str(k_spec):26s} sent est {r['est_bytes']:8.0f} xla {r['xla_bytes']:8.0f} "
              f"({r['bytes']:.2f})  memory est {r['est_memory']:8.0f} xla {r['xla_memory']:8.0f} "
              f"({r['memory']:.2f}){flag}", flush=True)
    print(f"\n{len(rows)} pairs on mesh {args.mesh} in {time.time() - t0:.0f} s")
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
