"""automap.propagate: exact specs after actions, earliest decision wins, implied collectives."""
import jax
import jax.numpy as jnp
import pytest

from automap.ir.lower import lower
from automap.propagate import Reshard, apply, reshards
from automap.shardings import Action, ShardingError, ShardingState
from automap.trace import trace

AXES = {"data": 2, "model": 4}
F32 = jnp.float32
D, M, DM, MD, R = ("data",), ("model",), ("data", "model"), ("model", "data"), ()


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def program(fn, *args):
    t = trace(fn, args)
    return lower(t.closed_jaxpr, t.in_paths, t.out_paths)


def state_after(prog, *decisions, freeze=()):
    """Apply each decision (a list of (input index, dim, axis)) in order."""
    s = ShardingState.initial(prog, AXES)
    for k, decision in enumerate(decisions):
        actions = [Action(prog.inputs[i], d, a) for i, d, a in decision]
        s = apply(s, actions, freeze=[prog.inputs[i] for i in freeze] if k == 0 else (), label=f"d{k}")
    return s


def specs_by_op(prog, s):
    """(primitive, [spec of each input and output]) for every op, nested ones included."""
    return [(op.primitive, [s.spec(v) for v in op.inputs + op.outputs]) for op in prog.all_ops]


def _mlp2(x, w1, w2):
    return jnp.tanh(x @ w1) @ w2


MLP_ARGS = (sds(8, 16), sds(16, 32), sds(32, 16))


# ---------------------------------------------------------------------------- forward chains

@pytest.mark.parametrize("decisions, want, collectives", [
    # Megatron: column-parallel w1, row-parallel w2; the hidden is split, the output a partial sum
    ([[(1, 1, "model"), (2, 0, "model")]],
     [("dot_general", [(R, R), (R, M), (R, M)]), ("tanh", [(R, M), (R, M)]),
      ("dot_general", [(R, M), (M, R), (R, R)])],
     [("all-reduce", M, 8 * 16 * 4)]),
    # Megatron + batch: every activation also carries the batch split
    ([[(1, 1, "model"), (2, 0, "model")], [(0, 0, "data")]],
     [("dot_general", [(D, R), (R, M), (D, M)]), ("tanh", [(D, M), (D, M)]),
      ("dot_general", [(D, M), (M, R), (D, R)])],
     [("all-reduce", M, 8 * 16 * 4 // 2)]),
    # batch over both axes: no collective at all
    ([[(0, 0, "data"), (0, 0, "model")]],
     [("dot_general", [(DM, R), (R, R), (DM, R)]), ("tanh", [(DM, R), (DM, R)]),
      ("dot_general", [(DM, R), (R, R), (DM, R)])],
     []),
    # the earlier batch decision wins over a later FSDP-style split of w1's contracting dim on the
    # same axis: with 'model' (4) idle and the result (512 B a device) under half of w1, XLA's dot
    # partitioner moves w1's split onto 'model' by a collective-permute and sums the partial results
    # over 'model' (XLA's collectives for jax.jit with these specs, exactly;
    # tests/automap/cost/test_against_xla.py::test_a_dot_leaving_a_mesh_axis_idle_is_split_over_it_too)
    ([[(0, 0, "data")], [(1, 0, "data")]],
     [("dot_general", [(D, R), (D, R), (D, R)]), ("tanh", [(D, R), (D, R)]),
      ("dot_general", [(D, R), (R, R), (D, R)])],
     [("collective-permute", ("data", "model"), 16 * 32 * 4 // 4), ("all-reduce", M, 8 * 32 * 4 // 2)]),
])
def test_mlp_forward(decisions, want, collectives):
    prog = program(_mlp2, *MLP_ARGS)
    s = state_after(prog, *decisions)
    assert specs_by_op(prog, s) == want
    assert [(r.kind, r.axes, r.bytes) for r in reshards(s)] == collectives


def test_batch_through_forward_and_backward():
    def loss(params, x):
        return (jnp.tanh(x @ params["w1"]) @ params["w2"]).sum()

    prog = program(jax.value_and_grad(loss), {"w1": sds(16, 32), "w2": sds(32, 4)}, sds(8, 16))
    assert prog.input_paths == ("params/w1", "params/w2", "x")
    s = state_after(prog, [(2, 0, "data")])
    # every activation and activation gradient (leading dim 8) is batch-split, forward and backward
    for op in prog.all_ops:
        for v in op.inputs + op.outputs:
            value = prog.value(v)
            if value.ndim and value.shape[0] == 8:
                assert s.spec(v)[0] == D, (op, value)
    # parameters and their gradients stay whole; the gradients are all-reduced over the batch axis
    for v in prog.inputs[:2] + prog.outputs[1:]:
        assert s.spec(v) == (R, R), prog.value(v)
    got = [(r.kind, r.axes, r.bytes, prog.value(r.value).shape) for r in reshards(s)]
    assert got == [
        ("all-reduce", D, 4, ()),  # the loss
        ("all-reduce", D, 4 * 32 * 4, (4, 32)),  # dL/dw2 (before its transpose)
        ("all-reduce", D, 32 * 16 * 4, (32, 16)),  # dL/dw1 (before its transpose)
    ]
    assert all(r.kind == "all-reduce" and r.where == "result" for r in reshards(s))


def test_conflict_earlier_decision_wins_and_becomes_a_collective():
    # x is sharded on its batch dim by the first decision; the second asks for its *feature* dim
    # (the contracting dim of x @ w) on the same axis through w. The batch wins; w is gathered.
    prog = program(lambda x, w: jnp.tanh(x @ w), sds(8, 16), sds(16, 32))
    s = state_after(prog, [(0, 0, "data")], [(1, 0, "data"), (1, 1, "model")])
    assert s.spec(prog.inputs[0]) == (D, R)
    assert s.spec(prog.inputs[1]) == (D, M)
    assert s.spec(prog.outputs[0]) == (D, M)
    assert s.why(prog.outputs[0], 0) == "d0" and s.why(prog.outputs[0], 1) == "d1"
    (r,) = reshards(s)
    assert r == Reshard(op=prog.ops[0].id, value=prog.inputs[1], kind="all-gather", axes=D,
                        bytes=16 * 32 * 4 // 4, count=1, where="operand")


def test_frozen_values_are_not_changed():
    prog = program(_mlp2, *MLP_ARGS)
    # x and w2 frozen by the first decision (as manual rules freeze the inputs they pin)
    s = state_after(prog, [(1, 1, "model")], [(0, 0, "data")], freeze=(0, 2))
    x, w1, w2 = prog.inputs
    assert s.spec(x) == (D, R)  # the later decision on x itself is applied
    assert s.spec(w2) == (R, R)  # frozen: the hidden's model split does not reach it
    assert s.spec(prog.outputs[0]) == (D, R)
    assert s.frozen == frozenset({x, w2})
    # a whole w2 against a model-split hidden is sliced locally (free); the product is a partial sum
    assert [(r.kind, r.axes, prog.value(r.value).shape, r.bytes) for r in reshards(s)] == [
        ("all-reduce", M, (8, 16), 8 * 16 * 4 // 2)]


# ---------------------------------------------------------------------------- multi-axis batch

@pytest.mark.parametrize("batch, order, want", [
    (16, ("data", "model"), DM),
    (16, ("model", "data"), MD),
    (8, ("data", "model"), DM),
])
def test_multi_axis_batch_extends(batch, order, want):
    prog = program(_mlp2, sds(batch, 16), *MLP_ARGS[1:])
    s = state_after(prog, [(0, 0, a) for a in order])
    assert s.spec(prog.outputs[0]) == (want, R)
    assert all(s.spec(op.outputs[0])[0] == want for op in prog.all_ops)
    assert reshards(s) == []


def test_propagation_extends_a_prefix():
    # a later decision adds 'model' after 'data' on x's batch dim: everything downstream follows
    prog = program(_mlp2, *MLP_ARGS)
    s = state_after(prog, [(0, 0, "data")], [(0, 0, "model")])
    assert [s.spec(op.outputs[0]) for op in prog.all_ops] == [(DM, R)] * 3


# ---------------------------------------------------------------------------- reshape

@pytest.mark.parametrize("decision, want", [
    # split 16 -> 4 x 4: 'data' (2) fits in the major 4, 'model' (4) would need the remaining 2 x minor
    ([(0, 0, "data"), (0, 0, "model")], [(DM, R), (D, R, R), (D, R, R), (D, R), (D,)]),
    # 'model' fills the major 4 exactly, 'data' moves to the minor factor; merging gives both back
    ([(0, 0, "model"), (0, 0, "data")], [(MD, R), (M, D, R), (M, D, R), (MD, R), (MD,)]),
    # a split minor dim: merging (16, 6) -> 96 can not keep it (not a block tiling)
    ([(0, 1, "data")], [(R, D), (R, R, D), (R, R, D), (R, D), (R,)]),
])
def test_reshape_split_and_merge(decision, want):
    prog = program(lambda x: (x.reshape(4, 4, 6) * 2).reshape(16, 6).reshape(96), sds(16, 6))
    s = state_after(prog, decision)
    got = [s.spec(prog.inputs[0])] + [s.spec(op.outputs[0]) for op in prog.all_ops]
    assert got == want
    assert [op.primitive for op in prog.all_ops] == ["reshape", "mul", "reshape", "reshape"]


def test_reshape_backwards():
    # a decision on the output flows back through the merge to the operand's major dim
    prog = program(lambda x: x.reshape(16, 6) + 1, sds(4, 4, 6))
    s = ShardingState.initial(prog, AXES)
    s = apply(s, [Action(prog.outputs[0], 0, "model")])
    assert s.spec(prog.inputs[0]) == (M, R, R)


# ---------------------------------------------------------------------------- scan

def _scan_model(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), h.sum(1)

    return jax.lax.scan(body, x, ws)


def test_scan_body_gets_the_carry_spec():
    prog = program(_scan_model, sds(4, 16, 16), sds(8, 16))
    ws, x = prog.inputs
    s = state_after(prog, [(1, 0, "data")])
    (scan,) = prog.ops
    (body,) = scan.regions
    carry_in, w_in = body.inputs
    assert s.spec(carry_in) == (D, R)
    assert s.spec(w_in) == (R, R)
    assert [s.spec(v) for v in body.outputs] == [(D, R), (D,)]
    # outer results: the carry, and the stacked per-layer sums whose stacked dim stays whole
    assert [s.spec(v) for v in scan.outputs] == [(D, R), (R, D)]
    assert s.spec(ws) == (R, R, R)
    assert reshards(s) == []


def test_scan_stacked_dim_stays_unsharded():
    prog = program(_scan_model, sds(4, 16, 16), sds(8, 16))
    ws, x = prog.inputs
    s = state_after(prog, [(0, 0, "data")])  # shard the layers dim of the stacked weights
    (scan,) = prog.ops
    (body,) = scan.regions
    assert s.spec(ws) == (D, R, R)
    # nothing crosses into the body, and the stacked dim is gathered at the scan
    assert all(s.spec(v) == tuple(R for _ in prog.value(v).shape) for v in body.inputs + body.outputs)
    assert [(r.op, r.value, r.kind, r.axes, r.bytes) for r in reshards(s)] == [
        (scan.id, ws, "all-gather", D, 4 * 16 * 16 * 4)]


def test_scan_body_collectives_count_trips():
    prog = program(_scan_model, sds(4, 16, 16), sds(8, 16))
    s = state_after(prog, [(1, 1, "model")])  # the carry's feature dim: contracting in the body
    (scan,) = prog.ops
    (body,) = scan.regions
    body_ops = {op.id for op in body.ops}
    rs = [r for r in reshards(s) if r.op in body_ops]
    assert rs and {r.count for r in rs} == {4}


# ---------------------------------------------------------------------------- legality

@pytest.mark.parametrize("action, message", [
    ((0, 0, "nope"), "not a mesh axis"),
    ((0, 2, "data"), "out of range"),
    ((0, 1, "model"), "not divisible by 4"),
])
def test_illegal_actions(action, message):
    prog = program(lambda x: x * 2, sds(8, 6))
    s = ShardingState.initial(prog, AXES)
    with pytest.raises(ShardingError, match=message):
        apply(s, [Action(prog.inputs[action[0]], action[1], action[2])])


def test_axis_twice_on_one_value():
    prog = program(lambda x: x * 2, sds(8, 8))
    s = apply(ShardingState.initial(prog, AXES), [Action(prog.inputs[0], 0, "data")])
    with pytest.raises(ShardingError, match="already tiles dim 0"):
        apply(s, [Action(prog.inputs[0], 1, "data")])


@pytest.mark.parametrize("w_dim, x_shape, w_shape, want", [
    (1, (8, 16), (16, 512), (R, D)),  # output features of the larger weight: x is gathered
    (1, (512, 16), (16, 8), (D, R)),  # the larger activation wins: the weight is gathered
    (0, (8, 256), (256, 64), (D, R)),  # a contracting dim cannot shard the result: the weight is gathered
])
def test_a_contraction_breaks_a_tie_as_xla_propagation_does(w_dim, x_shape, w_shape, want):
    """x batch-split and w split over the same axis in one decision (as jax.jit sees in_shardings):
    the result keeps the larger operand's non-contracting split (XLA's propagation, Shardy); in
    linked order alone the batch won whatever the sizes."""
    prog = program(lambda x, w: x @ w, sds(*x_shape), sds(*w_shape))
    s = state_after(prog, [(0, 0, "data"), (1, w_dim, "data")], freeze=[0, 1])
    assert s.spec(prog.outputs[0]) == want


def test_a_weight_gradient_whose_operands_agree_reduces_its_partial_sum():
    """x and dy split on the batch and the gradient on its rows over the same axis, all decided at
    once: the operands agree on the batch (two proposals against the result's one), so the
    contraction runs split on it and its partial sum is scattered, as XLA compiles it; the
    activations are not gathered."""
    prog = program(lambda x, dy: jax.lax.dot_general(x, dy, (((0,), (0,)), ((), ()))), sds(64, 32), sds(64, 16))
    x, dy = prog.inputs
    (g,) = prog.outputs
    specs = {x: (D, R), dy: (D, R), g: (D, R)}
    s = ShardingState(prog, AXES, specs=specs, priority={(x, 0): 0, (dy, 0): 0, (g, 0): 0})
    # 'model' (4) is idle and at least the group: XLA's dot partitioner all-reduces a slice and
    # permutes it instead of the reduce-scatter (jax.jit with these shardings: all-reduce 1,024 B and
    # collective-permute 1,024 B)
    assert [(r.kind, r.axes, r.where) for r in reshards(s)] == [
        ("all-reduce", D, "result"), ("collective-permute", ("data", "model"), "result")]
