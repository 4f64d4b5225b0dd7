"""Elementwise primitives: one parallel factor per dim, shared by all operands and results;
scalar operands and rank-equal size-1 dims take no factor."""
import jax.numpy as jnp
import pytest
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint
from jax.experimental.shard_alike import shard_alike
from jax.sharding import PartitionSpec as P

from harness import MESH_8, check, ints, row

S = (16, 32)
DM = P("data", "model")


ROWS = [
    # name, fn, args, input specs, output spec, collective kinds
    row("unary_tanh", jnp.tanh, [S], {"x": DM}, DM, set()),
    row("unary_chain", lambda x: jnp.exp(-jnp.abs(x)) * jnp.sign(x), [S], {"x": DM}, DM, set()),
    row("binary_same", lax.add, [S, S], {"x": DM, "y": DM}, DM, set()),
    row("binary_one_sharded", lax.mul, [S, S], {"x": DM}, DM, set()),
    row("binary_other_sharded", lax.sub, [S, S], {"y": DM}, DM, set()),
    row("binary_complementary", lax.max, [S, S], {"x": P("data"), "y": P(None, "model")}, DM, set()),
    row("binary_1d", lax.atan2, [(32,), (32,)], {"x": P("x")}, P("x"), set(), mesh=MESH_8),
    row("scalar_literal", lambda x: x * 2.0 + 1.0, [S], {"x": DM}, DM, set()),
    row("scalar_operand", lambda x, s: lax.mul(x, s), [S, ()], {"x": DM}, DM, set()),
    row("scalar_array_operand", lambda s, x: lax.div(s, x), [(), S], {"x": DM}, DM, set()),
    row("integer_pow", lambda x: x ** 3, [S], {"x": DM}, DM, set()),
    row("pow", lambda x, y: jnp.abs(x) ** y, [S, S], {"y": DM}, DM, set()),
    # rank-equal size-1 broadcasting inside the primitive (lax ops allow it)
    row("size1_rows", lax.add, [S, (1, 32)], {"x": DM, "y": P(None, "model")}, DM, set()),
    row("size1_cols", lax.mul, [S, (16, 1)], {"x": DM}, DM, set()),
    row("size1_operand_sharded", lax.sub, [(1, 32), S], {"x": P(None, "model"), "y": P("data")}, DM, set()),
    row("size1_both", lax.add, [(16, 1), (1, 32)], {"x": P("data"), "y": P(None, "model")}, DM, set()),
    row("compare_select", lambda x, y: jnp.where(x > y, x, y * 2), [S, S], {"x": DM}, DM, set(),
        inner={"gt": DM}),
    row("select_n_pred_sharded", lambda p, x, y: lax.select_n(p, x, y), [ints(S, 2), S, S],
        {"p": DM}, DM, set()),
    row("clamp_scalar_bounds", lambda x: lax.clamp(-0.5, x, 0.5), [S], {"x": DM}, DM, set()),
    row("clamp_array_bounds", lax.clamp, [S, S, S], {"x": DM}, DM, set()),
    row("convert", lambda x: (x * 4).astype(jnp.int32), [S], {"x": DM}, DM, set(),
        inner={"convert_element_type": DM}),
    row("integer_logic", lambda a, b: (a & b) | (a >> 1) ^ (b << 2), [ints(S, 100), ints(S, 100)],
        {"a": DM, "b": DM}, DM, set()),
    row("is_finite_not", lambda x: ~jnp.isfinite(jnp.log(x)), [S], {"x": DM}, DM, set()),
    row("rem_floor_round", lambda x, y: jnp.floor(x) + lax.rem(x, y + 3.0) + jnp.round(y), [S, S],
        {"x": P("data"), "y": P(None, "model")}, DM, set()),
    row("copy", lambda x: jnp.array(x, copy=True), [S], {"x": DM}, DM, set(), inner={"copy": DM}),
    row("reduce_precision", lambda x: lax.reduce_precision(x, 5, 10), [S], {"x": DM}, DM, set()),
    row("bitcast_same_width", lambda x: lax.bitcast_convert_type(x, jnp.int32), [S], {"x": DM}, DM, set()),
    row("bitcast_narrower", lambda x: lax.bitcast_convert_type(x, jnp.uint16), [S], {"x": DM},
        P("data", "model", None), set()),
    row("bitcast_wider", lambda x: lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.uint16), jnp.float32),
        [S], {"x": DM}, DM, set(), inner={"bitcast_convert_type": P("data", "model", None)}),
    row("optimization_barrier", lambda x, y: lax.optimization_barrier((x * 2, y + 1)), [S, (32,)],
        {"x": DM, "y": P("model")}, (DM, P("model")), set()),
    # two inputs disagree on which dim an axis shards: the earlier decision (x) wins
    row("conflict_moves_axis", lax.add, [S, S], {"x": P("data"), "y": P(None, "data")}, P("data"),
        {"all-to-all"}),
    # placement hints and the integer high multiply: elementwise
    row("shard_alike", lambda x, y: shard_alike(x * 2, y), [S, S], {"x": DM}, (DM, DM), set()),
    # XLA's partitioner gathers the operand of a layout constraint: the rule keeps it whole
    row("layout_constraint", lambda x: with_layout_constraint(x * 2, Layout((0, 1))), [S], {"x": DM}, P(),
        {"all-gather"}, inner={"mul": DM}),
]


@pytest.mark.parametrize("r", ROWS)
def test_elementwise(r):
    check(r)
