"""Shardy's sub-axes in the layout XLA gives a program from its input and output specs
(automap.sub_axes, automap.xla_layout), against XLA's measure of the compiled program (8
simulated CPU devices)."""
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap.cost.estimate import estimate
from automap.ir.lower import lower
from automap.shardings import ShardingState
from automap.xla_layout import xla_layout

MESH = {"data": 2, "model": 4}


def _attention_scores(x, w):
    """A projection to 32 features reshaped into 4 heads of 8, then each head's q.k scores."""
    q = jnp.einsum("bsi,io->bso", x, w).reshape(2, 8, 4, 8)
    return jnp.einsum("bshd,bthd->bhst", q, q)


def _laid_out(fn, args, in_specs, out_spec):
    prog = lower(jax.make_jaxpr(fn)(*args), [f"x{i}" for i in range(len(args))], ["out"])
    fixed = {v: tuple(((a,) if isinstance(a, str) else tuple(a or ())) for a in tuple(p) + (None,) * (
        len(prog.values[v].shape) - len(p))) for v, p in zip((*prog.inputs, *prog.outputs), (*in_specs, out_spec),
                                                              strict=True)}
    return xla_layout(ShardingState.initial(prog, MESH).replace(specs=fixed))


def test_a_reshape_splits_a_mesh_axis_between_the_heads_and_their_width():
    """The projection's 32 features over ('data', 'model') (the weight's split) reshaped into
    4 heads x 8: Shardy gives the heads ('data', "model":(1)2) and their width "model":(2)2, so
    the scores' dot runs on an eighth of the heads x width (equinox's MultiheadAttention under
    FSDP). With whole axes only the heads took 'data' and the dot ran on half: 8,192 dot FLOPs
    per device against XLA's 5,120, 1,792 B sent against its 2,048."""
    args = [jnp.ones((2, 8, 32)), jnp.ones((32, 32))]
    specs = [P(), P(None, ("data", "model"))]
    state = _laid_out(_attention_scores, args, specs, P())
    mesh = automap.make_mesh(MESH)
    jitted = jax.jit(_attention_scores, in_shardings=tuple(NamedSharding(mesh, p) for p in specs),
                     out_shardings=NamedSharding(mesh, P()))
    xla = automap.measure(jitted.lower(*args).compile())
    est = estimate(state)
    assert (est.dot_flops, est.wire_bytes) == (xla.dot_flops, xla.wire_bytes) == (5120, 2048)
    q = state.program.ops[1].outputs[0]  # the reshape's heads x width
    assert state.spec(q)[2:] == (("data", "model:(1)2"), ("model:(2)2",))


def test_a_layout_holding_whole_axes_keeps_the_mesh():
    """Where no value holds part of an axis, the layout is on the plan's own mesh."""
    args = [jnp.ones((2, 8, 32)), jnp.ones((32, 32))]
    state = _laid_out(_attention_scores, args, [P("data"), P()], P("data"))
    assert dict(state.axes) == MESH
    assert {a for spec in state.specs.values() for axes in spec for a in axes} == {"data"}
