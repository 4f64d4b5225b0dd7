"""dot_general and conv: batch / free / contracting factors; a sharded contraction is a partial sum."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from harness import MESH_8, check, row

matmul = lambda x, w: x @ w  # noqa: E731
bmm = lambda x, y: jnp.einsum("bij,bjk->bik", x, y)  # noqa: E731


def conv(x, k, groups=1):  # NHWC x HWIO -> NHWC
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                    feature_group_count=groups)


def depthwise(x, k):  # 8 channels, one group each, 2 outputs per group
    return conv(x, k, groups=8)


def grouped(x, k):  # 8 channels in 4 groups of 2, 4 outputs per group
    return conv(x, k, groups=4)


def patch(x, k):  # a patch embedding: window == stride, VALID; its input's rows tile its output's
    return lax.conv_general_dilated(x, k, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def pointwise(x, k):  # a 1x1 conv: the window-1 tiling
    return lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def spd_cholesky(a):
    return jnp.linalg.cholesky(a @ a.swapaxes(-1, -2) + 4 * jnp.eye(a.shape[-1]))


def tri_solve(a, b):
    return lax.linalg.triangular_solve(jnp.tril(a) + 4 * jnp.eye(4), b, left_side=True, lower=True)


G = np.array([3, 5, 6, 2], np.int32)  # group sizes of 16 rows in 4 experts


def ragged(x, w):
    return lax.ragged_dot(x, w, G)


def ragged_weight_grad(x, w):
    return jax.grad(lambda w: (ragged(x, w) ** 2).sum())(w)

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
    row("attention_scores_heads", lambda q, k: jnp.einsum("bhqd,bhkd->bhqk", q, k), [(2, 4, 8, 8), (2, 4, 8, 8)],
        {"q": P("data", "model"), "k": P("data", "model")}, P("data", "model"), set()),
    row("attention_values_heads", lambda p, v: jnp.einsum("bhqk,bhkd->bqhd", p, v), [(2, 4, 8, 8), (2, 4, 8, 8)],
        {"p": P(None, "model"), "v": P(None, "model")}, P(None, None, "model"), set()),
    row("matvec", matmul, [(16, 32), (32,)], {"x": P("data")}, P("data"), set()),
    row("vecvec", matmul, [(32,), (32,)], {"x": P("x")}, P(), {"all-reduce"}, mesh=MESH_8),
    row("outer", lambda a, b: jnp.einsum("i,j->ij", a, b), [(16,), (32,)], {"a": P("data"), "b": P("model")},
        P("data", "model"), set()),
    row("transposed_rhs", lambda x, w: x @ w.T, [(16, 32), (64, 32)], {"w": P("model")}, P(None, "model"), set(),
        inner={"transpose": P(None, "model")}),
    row("mlp_megatron", lambda x, w1, w2: jnp.tanh(x @ w1) @ w2, [(16, 32), (32, 64), (64, 32)],
        {"x": P("data"), "w1": P(None, "model"), "w2": P("model")}, P("data"), {"all-reduce"},
        inner={"tanh": P("data", "model")}),
    # batched linear algebra and FFTs: batch dims shared, core dims whole
    row("cholesky_batched", spd_cholesky, [(8, 4, 4)], {"a": P("data")}, P("data"), set(),
        inner={"cholesky": P("data")}),
    row("triangular_solve_batched", tri_solve, [(8, 4, 4), (8, 4, 16)], {"a": P("data"), "b": P("data")},
        P("data"), set(), inner={"triangular_solve": P("data")}),
    # XLA solves the independent columns of b whole: they are gathered
    row("triangular_solve_columns", tri_solve, [(8, 4, 4), (8, 4, 16)], {"b": P("data", None, "model")},
        P("data"), {"all-gather"}, inner={"triangular_solve": P("data")}),
    # XLA gathers an FFT's operand even when only its batch dim is sharded (also under plain
    # jax.jit with these shardings), its result sliced back: the op runs whole, the plan prices the gather
    row("fft_rows", jnp.fft.fft, [(16, 32)], {"a": P("data")}, P("data"), {"all-gather"}),
    row("rfft_then_scale", lambda a, s: jnp.fft.rfft(a) * s, [(16, 32), (16, 1)], {"a": P("data"), "s": P("data")},
        P("data"), {"all-gather"}),
    row("conv_batch", conv, [(8, 6, 6, 4), (3, 3, 4, 16)], {"x": P("data")}, P("data"), set()),
    row("conv_out_features", conv, [(8, 6, 6, 4), (3, 3, 4, 16)], {"x": P("data"), "k": P(None, None, None, "model")},
        P("data", None, None, "model"), set()),
    row("conv_in_features", conv, [(8, 6, 6, 8), (3, 3, 8, 16)], {"k": P(None, None, "model")},
        P(), {"all-reduce"}),
    row("conv_depthwise_batch", depthwise, [(8, 6, 6, 8), (3, 3, 1, 16)], {"x": P("data")}, P("data"), set()),
    row("conv_depthwise_channels", depthwise, [(8, 6, 6, 8), (3, 3, 1, 16)], {"x": P("data", None, None, "model")},
        P("data", None, None, "model"), set(), inner={"conv_general_dilated": P("data", None, None, "model")}),
    # a conv whose windows tile its input splits over the output positions, no halo, no collective
    row("conv_patch_rows", patch, [(4, 16, 16, 3), (4, 4, 3, 16)], {"x": P(None, "model")}, P(None, "model"), set(),
        inner={"conv_general_dilated": P(None, "model")}),
    row("conv_patch_rows_columns", patch, [(4, 16, 16, 3), (4, 4, 3, 16)], {"x": P(None, "data", "model")},
        P(None, "data", "model"), set()),
    row("conv_1x1_rows", pointwise, [(4, 8, 8, 4), (1, 1, 4, 16)], {"x": P(None, "model")}, P(None, "model"), set()),
    # overlapping windows: the rows stay split, each device sent its windows' halo rows (automap.conv_halos)
    row("conv_3x3_rows_halos", conv, [(8, 8, 6, 4), (3, 3, 4, 16)], {"x": P(None, "model")}, P(None, "model"),
        {"collective-permute"}),
    # XLA partitions a grouped (not depthwise) conv in no dim, not even its batch: gathered
    row("conv_grouped_whole", grouped, [(8, 6, 6, 8), (3, 3, 2, 16)],
        {"x": P("data"), "k": P(None, None, None, "model")},
        P(), {"all-gather"}, inner={"conv_general_dilated": P()}),
    # ragged_dot (mixture of experts): rows in groups are blocked, n parallel, k and experts reductions
    row("ragged_dot_n", ragged, [(16, 8), (4, 8, 32)], {"w": P(None, None, "model")}, P(None, "model"), set()),
    row("ragged_dot_k", ragged, [(16, 8), (4, 8, 32)], {"x": P(None, "model"), "w": P(None, "model")}, P(),
        {"all-reduce"}),
    # (XLA also shards the constant group sizes like the experts and gathers them back: 16 bytes)
    row("ragged_dot_experts", ragged, [(16, 8), (4, 8, 32)], {"w": P("model")}, P(), {"all-reduce", "all-gather"},
        model={"all-reduce"}),
    row("ragged_dot_rows_blocked", ragged, [(16, 8), (4, 8, 32)], {"x": P("data")}, P(), {"all-gather"}),
    # the weight gradient: the ragged contracting dim stays whole (the experts dim of the result is
    # parallel, in no operand: tests/automap/cost/test_against_xla.py)
    row("ragged_dot_weight_grad", ragged_weight_grad, [(16, 8), (4, 8, 32)], {"w": P(None, None, "model")},
        P(None, None, "model"), set()),
    # block-scaled dots: a dot_general whose scales follow their operands' free dims
    row("scaled_dot_rows", lambda a, b: lax.scaled_dot(a, b.T), [(16, 32), (64, 32)], {"a": P("data")},
        P("data"), set()),
]


@pytest.mark.parametrize("r", ROWS)
def test_dot(r):
    check(r)
