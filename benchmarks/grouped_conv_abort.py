"""Which layouts of a grouped convolution's kernel gradient XLA:CPU compiles and which abort the
process, each compiled in a subprocess of its own (an abort is a ``Check failed`` in XLA, not a
Python exception). Why every program automap compiles constrains such a conv to its groups'
layout (:mod:`automap.grouped_conv_guard`): a factor rule splitting its groups let the search pick
input specs from which XLA's own propagation split the conv's lhs batch unevenly over the groups
(held-out hf_regnet's default plan, the inputs-only program; ``tests/automap/test_grouped_conv_guard.py``).

    python benchmarks/grouped_conv_abort.py

Measured on jax 0.10.2, mesh data=2 x model=4, the lhs batch (the channels, ``groups x 8``), the
cotangent's and the result's features on the same axes: 2 groups on 'data' compile, on 'model'
or ('data', 'model') abort (``convolution_handler.cc:984 Check failed: new_input_batch_size %
new_output_batch_size == 0``); 4 groups on 'data' or 'model' compile, on both abort; 8 groups
compile on all three: XLA aborts whenever the split does not divide the groups.
"""
import subprocess
import sys

_ONE = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 4), ("data", "model"))
groups, axes = {groups}, {axes!r}
spec = NamedSharding(mesh, P(None, None, None, axes))
conv = lambda x, dy: jax.lax.conv_general_dilated(x, dy, (1, 1), ((1, 0), (1, 0)), rhs_dilation=(2, 2),
    dimension_numbers=("CHWN", "IHWO", "HWNC"), batch_group_count=groups)
x, dy = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((8, 8, 8, 8 * groups), (8, 4, 4, 8 * groups)))
jax.jit(conv, in_shardings=(spec, spec), out_shardings=spec).lower(x, dy).compile()
"""


def compiles(groups: int, axes: str | tuple[str, ...]) -> bool:
    """Whether the kernel gradient of ``groups`` groups, split over ``axes``, compiles."""
    done = subprocess.run([sys.executable, "-c", _ONE.format(groups=groups, axes=axes)], capture_output=True)
    return done.returncode == 0


def main() -> int:
    for groups in (2, 4, 8):
        row = {str(axes): "compiles" if compiles(groups, axes) else "ABORTS"
               for axes in ("data", "model", ("data", "model"))}
        print(f"{groups} groups: " + ", ".join(f"{axes} {got}" for axes, got in row.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
