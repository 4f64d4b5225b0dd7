"""Reductions (reduced dims are reduction factors: sharded -> a partial result, all-reduced),
arg-reductions, cumulative ops and sort (the scanned / sorted dim is blocked)."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from harness import MESH_8, check, row

S = (16, 32)
DM = P("data", "model")
NHWC = (8, 8, 8, 4)


def variadic_reduce(x):  # (sum, max) in one reduce with a user computation
    return lax.reduce((x, x), (0.0, -jnp.inf), lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (1,))


def avg_pool(x):
    return lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") / 4


def max_pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

ROWS = [
    # name, fn, args, input specs, output spec, collective kinds
    row("sum_unsharded_dim", lambda x: x.sum(1), [S], {"x": P("data")}, P("data"), set()),
    row("sum_sharded_dim", lambda x: x.sum(1), [S], {"x": DM}, P("data"), {"all-reduce"}),
    row("sum_all", lambda x: x.sum(), [S], {"x": DM}, P(), {"all-reduce"}),
    row("sum_two_of_three", lambda x: x.sum((0, 2)), [(8, 16, 32)], {"x": P("data", "model")}, P("model"),
        {"all-reduce"}),
    row("sum_kept_sharded_dim", lambda x: x.sum(0), [S], {"x": P(None, "model")}, P("model"), set()),
    row("mean_sharded", lambda x: x.mean(1), [S], {"x": P(None, ("data", "model"))}, P(), {"all-reduce"}),
    row("max_sharded", lambda x: x.max(1), [S], {"x": DM}, P("data"), {"all-reduce"}),
    row("min_unsharded", lambda x: x.min(0), [S], {"x": P(None, "model")}, P("model"), set()),
    row("prod_sharded", lambda x: jnp.prod(1 + 0.1 * x, axis=0), [S], {"x": P("x")}, P(), {"all-reduce"},
        mesh=MESH_8),
    row("all_sharded", lambda x: jnp.all(x > -3, axis=1), [S], {"x": DM}, P("data"), {"all-reduce"}),
    row("any_unsharded", lambda x: jnp.any(x > 1, axis=1), [S], {"x": P("data")}, P("data"), set()),
    row("softmax_sharded_dim", jax.nn.softmax, [S], {"x": DM}, DM, {"all-reduce"},
        inner={"reduce_max": P("data"), "exp": DM}),
    row("logsumexp_unsharded_dim", lambda x: jax.nn.logsumexp(x, axis=1), [S], {"x": P("data")},
        P("data"), set()),
    row("argmax_unsharded_dim", lambda x: jnp.argmax(x, axis=1), [S], {"x": P("data")}, P("data"), set()),
    row("argmin_kept_sharded", lambda x: jnp.argmin(x, axis=0), [S], {"x": P(None, "model")}, P("model"), set()),
    # the index of the maximum needs the whole dim: blocked, x is gathered along it
    row("argmax_sharded_dim", lambda x: jnp.argmax(x, axis=1), [S], {"x": DM}, P("data"), {"all-gather"}),
    row("cumsum_unsharded_dim", lambda x: jnp.cumsum(x, axis=1), [S], {"x": P("data")}, P("data"), set()),
    row("cumsum_blocked", lambda x: jnp.cumsum(x, axis=1), [S], {"x": DM}, P("data"), {"all-gather"}),
    row("cummax_reverse", lambda x: lax.cummax(x, axis=0, reverse=True), [S], {"x": P(None, "model")},
        P(None, "model"), set()),
    row("sort_unsharded_dim", lambda x: jnp.sort(x, axis=1), [S], {"x": P("data")}, P("data"), set()),
    row("sort_blocked", lambda x: jnp.sort(x, axis=1), [S], {"x": DM}, P("data"), {"all-gather"}),
    row("argsort", lambda x: jnp.argsort(x, axis=0), [S], {"x": P(None, "model")}, P(None, "model"), set(),
        inner={"iota": P(None, "model"), "sort:1": P(None, "model")}),
    row("sort_multi_operand", lambda k, v: lax.sort((k, v), dimension=1, num_keys=1), [S, S],
        {"k": P("data"), "v": P(None, "model")}, (P("data"), P("data")), {"all-gather"}),
    # XLA's SPMD partitioner does not partition chlo.top_k: it gathers the operand even when only
    # the independent rows are sharded (also under plain jax.jit), and slices the picks back to the rows' split
    row("top_k", lambda x: lax.top_k(x, 4), [S], {"x": P("data")}, (P("data"), P("data")), {"all-gather"}),
    row("top_k_axis0", lambda x: lax.top_k(x, 4, axis=0), [S], {"x": P(None, "model")},
        (P(None, "model"), P(None, "model")), {"all-gather"}),
    row("approx_max_k", lambda x: lax.approx_max_k(x, 4)[0], [S], {"x": P("data")}, P("data"), set()),
    # a variadic reduction with a user computation: reduced dims stay whole
    row("variadic_reduce_kept", variadic_reduce, [S], {"x": P("data")}, (P("data"), P("data")), set()),
    row("variadic_reduce_blocked", variadic_reduce, [S], {"x": DM}, (P("data"), P("data")), {"all-gather"}),
    # pooling: windowed dims stay whole, the others are shared
    row("avg_pool", avg_pool, [NHWC], {"x": P("data", None, None, "model")}, P("data", None, None, "model"), set(),
        inner={"reduce_window_sum": P("data", None, None, "model")}),
    row("max_pool_window_dim_sharded", max_pool, [NHWC], {"x": P("data", "model")}, P("data"), {"all-gather"}),
    row("max_pool_grad", jax.grad(lambda x: max_pool(x).sum()), [NHWC], {"x": P("data", None, None, "model")},
        P("data", None, None, "model"), set(), inner={"select_and_scatter_add": P("data", None, None, "model")}),
]


@pytest.mark.parametrize("r", ROWS)
def test_reduce(r):
    check(r)
