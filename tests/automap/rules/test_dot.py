"""dot_general and conv: batch / free / contracting factors; a sharded contraction is a partial sum."""
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from harness import MESH_8, check, row

matmul = lambda x, w: x @ w  # noqa: E731
bmm = lambda x, y: jnp.einsum("bij,bjk->bik", x, y)  # noqa: E731


def conv(x, k):  # NHWC x HWIO -> NHWC
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


ROWS = [
    # name, fn, args, input specs, output spec, collective kinds
    row("free_lhs", matmul, [(16, 32), (32, 64)], {"x": P("data")}, P("data"), set()),
    row("free_rhs", matmul, [(16, 32), (32, 64)], {"w": P(None, "model")}, P(None, "model"), set()),
    row("free_both", matmul, [(16, 32), (32, 64)], {"x": P("data"), "w": P(None, "model")},
        P("data", "model"), set()),
    row("free_two_axes", matmul, [(16, 32), (32, 64)], {"x": P(("data", "model"))}, P(("data", "model")), set()),
    row("contracting", matmul, [(16, 32), (32, 64)], {"x": P(None, "model"), "w": P("model")},
        P(), {"all-reduce"}),
    row("contracting_lhs_only", matmul, [(16, 32), (32, 64)], {"x": P(None, "model")}, P(), {"all-reduce"}),
    row("contracting_and_free", matmul, [(16, 32), (32, 64)], {"x": P("data", "model"), "w": P("model")},
        P("data"), {"all-reduce"}),
    # the partial sum's result is wanted sharded on the contraction's axis: a reduce-scatter
    row("contracting_scatter", lambda x, w, b: (x @ w) * b, [(16, 32), (32, 64), (64,)],
        {"x": P(None, "model"), "w": P("model"), "b": P("model")}, P(None, "model"), {"reduce-scatter"},
        inner={"dot_general": P(None, "model")}),
    row("batch", bmm, [(8, 16, 32), (8, 32, 16)], {"x": P("data")}, P("data"), set()),
    row("batch_free", bmm, [(8, 16, 32), (8, 32, 16)], {"x": P("data", "model")}, P("data", "model"), set()),
    row("batch_contracting", bmm, [(8, 16, 32), (8, 32, 16)], {"x": P("data", None, "model"), "y": P("data", "model")},
        P("data"), {"all-reduce"}),
    row("matvec", matmul, [(16, 32), (32,)], {"x": P("data")}, P("data"), set()),
    row("vecvec", matmul, [(32,), (32,)], {"x": P("x")}, P(), {"all-reduce"}, mesh=MESH_8),
    row("outer", lambda a, b: jnp.einsum("i,j->ij", a, b), [(16,), (32,)], {"a": P("data"), "b": P("model")},
        P("data", "model"), set()),
    row("transposed_rhs", lambda x, w: x @ w.T, [(16, 32), (64, 32)], {"w": P("model")}, P(None, "model"), set(),
        inner={"transpose": P(None, "model")}),
    row("mlp_megatron", lambda x, w1, w2: jnp.tanh(x @ w1) @ w2, [(16, 32), (32, 64), (64, 32)],
        {"x": P("data"), "w1": P(None, "model"), "w2": P("model")}, P("data"), {"all-reduce"},
        inner={"tanh": P("data", "model")}),
    row("conv_batch", conv, [(8, 6, 6, 4), (3, 3, 4, 16)], {"x": P("data")}, P("data"), set()),
    row("conv_out_features", conv, [(8, 6, 6, 4), (3, 3, 4, 16)], {"x": P("data"), "k": P(None, None, None, "model")},
        P("data", None, None, "model"), set()),
    row("conv_in_features", conv, [(8, 6, 6, 8), (3, 3, 8, 16)], {"k": P(None, None, "model")},
        P(), {"all-reduce"}),
]


@pytest.mark.parametrize("r", ROWS)
def test_dot(r):
    check(r)
