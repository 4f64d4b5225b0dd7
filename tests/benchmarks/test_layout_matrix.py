"""``benchmarks/layout_matrix.py``: one dense layer's forward + backward under a pair of input
specs, the estimate of XLA's layout against ``jax.jit`` compiled, and the summary it prints;
``benchmarks/fidelity.py``'s ``--mesh`` parser (doctests)."""
import doctest

from bench_module import load
from jax.sharding import PartitionSpec as P


def test_a_row_compares_the_estimate_with_what_jit_compiles():
    bench = load("layout_matrix")
    assert len(bench.H_SPECS) * len(bench.K_SPECS) == 56
    # h (model, -, data), k (model, data): XLA gathers h's features over 'data' for the forward dot
    # and its weight gradient, k over 'model' for both dots: 36,864 B sent, as estimated
    r = bench.row(P("model", None, "data"), P("model", "data"), {"data": 2, "model": 4})
    assert (r["est_bytes"], r["xla_bytes"]) == (36864, 36864) and r["bytes"] == 1.0
    assert 0.75 <= r["memory"] <= 1.25
    lines = bench.summary([r, dict(r, bytes=0.5)])
    assert lines == ["bytes: 1 of 2 outside 10% (est/XLA from 0.50 to 1.00)",
                     f"memory: 0 of 2 outside 25% (est/XLA from {r['memory']:.2f} to {r['memory']:.2f})"]


def test_the_mesh_option():
    fidelity = load("fidelity")
    assert doctest.testmod(fidelity, optionflags=doctest.ELLIPSIS).failed == 0
    assert fidelity.mesh_arg("8x1") == {"data": 8, "model": 1}
