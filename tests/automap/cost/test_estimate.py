"""The cost model's closed forms on the zoo GPT, and agreement with what XLA compiled."""
import math

import jax
import pytest
from jax import tree_util
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import zoo
from automap.cost import Topology, estimate

CFG = dict(layers=2, vocab=64, seq=16, d_model=32, heads=4, batch=8)


def _rules(specs_tree, prefix):
    return [
        (f"^{prefix}/" + "/".join(str(k.key) for k in path) + "$", spec)
        for path, spec in tree_util.tree_flatten_with_path(specs_tree, is_leaf=lambda x: isinstance(x, P))[0]
        if any(e is not None for e in spec)
    ]


def _plan(strategy, mesh_axes, scan=False):
    w = zoo.gpt_linen(zoo.GPTConfig(scan=scan, **CFG))
    state, batch = w.init(0)
    mesh = automap.make_mesh(mesh_axes)
    s, b = getattr(zoo.experts, strategy)(state, batch, mesh)
    rules = _rules(s["params"], "state/params") + _rules(b, "batch")
    step = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.manual(rules)])
    return w, state, batch, step, step.plan(state, batch)


def _param_bytes(state):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]))


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_data_parallel_gradient_all_reduce_equals_parameter_bytes(scan):
    _, state, _, _, plan = _plan("data_parallel", {"data": 8}, scan)
    program = plan.program
    grads = [c for c in plan.estimate.collectives if c.kind == "all-reduce" and program.values[c.value].ndim > 0]
    assert sum(c.bytes * c.count for c in grads) == _param_bytes(state)
    assert all(c.axes == ("data",) for c in grads)


def test_megatron_forward_all_reduces_two_per_layer():
    _, _, _, _, plan = _plan("megatron", {"data": 2, "model": 4})
    program = plan.program
    act = (CFG["batch"] // 2) * CFG["seq"] * CFG["d_model"] * 4  # batch split over data
    fwd = [
        c for c in plan.estimate.collectives
        if c.kind == "all-reduce" and program.values[c.value].phase == "forward" and "blocks_" in c.module
    ]
    assert len(fwd) == 2 * CFG["layers"]
    assert all(c.bytes == act and c.axes == ("model",) for c in fwd)
    assert {c.module.split("/")[-1] for c in fwd} == {"out", "down"}  # row-parallel projections


def test_fsdp_gathers_each_parameter_once_and_xla_agrees():
    w, state, batch, step, plan = _plan("fsdp", {"data": 8})
    program = plan.program
    est = plan.estimate
    kernels = {v for v in program.inputs if program.values[v].name.startswith("state/params")
               and program.values[v].name.endswith("kernel")}
    sharded = {v for v in kernels if plan.state.spec(v) != tuple(() for _ in program.values[v].shape)}
    assert len(sharded) == len(kernels) == 4 * CFG["layers"] + 1  # qkv, out, up, down; head
    gathers = [c for c in est.collectives if c.kind == "all-gather" and c.value in sharded]
    # gathered once for the forward pass and kept for the backward pass (as XLA's CSE does)
    assert sorted(c.value for c in gathers) == sorted(sharded)
    for c in gathers:
        assert c.bytes == program.values[c.value].nbytes  # the whole parameter on every device
    m = automap.measure(step.lower(state, batch).compile())
    assert abs(est.collective_bytes - m.collective_bytes) <= 0.10 * m.collective_bytes
    assert abs(est.wire_bytes - m.wire_bytes) <= 0.10 * m.wire_bytes
    # gathers and scatters each send 7/8 of their buffer, all-reduces 14/8
    assert est.wire_bytes == pytest.approx(sum(
        c.bytes * c.count * (2 if c.kind == "all-reduce" else 1) * 7 / 8 for c in est.collectives))
    assert abs(est.peak_memory_bytes - m.memory_per_device) <= 0.25 * m.memory_per_device
    assert est.dot_flops == m.dot_flops


def test_estimate_matches_xla_for_megatron_and_time_follows_topology():
    _, state, batch, step, plan = _plan("megatron", {"data": 2, "model": 4})
    m = automap.measure(step.lower(state, batch).compile())
    est = plan.estimate
    assert abs(est.collective_bytes - m.collective_bytes) <= 0.01 * m.collective_bytes
    assert est.dot_flops == m.dot_flops
    # the same plan on a slower interconnect costs more communication time, same bytes
    slow = Topology.preset("h100-2x8")
    fast = Topology.preset("h100-8")
    e_slow = estimate(plan.state, slow.with_links(data=slow.levels[-1].link, model=slow.levels[-1].link))
    e_fast = estimate(plan.state, fast)
    assert e_slow.collective_bytes == e_fast.collective_bytes
    assert e_slow.comm_time_s > e_fast.comm_time_s
    assert math.isclose(e_slow.compute_time_s, e_fast.compute_time_s)
    assert "estimate" in plan.report()


def _latency_paid(plan, kind):
    return sum(1 for c in plan.estimate.collectives if c.kind == kind and not c.combined)


@pytest.mark.parametrize("strategy, mesh_axes, slack", [
    ("data_parallel", {"data": 8}, 0),  # every gradient all-reduce in one: 1 and 1
    ("megatron", {"data": 2, "model": 4}, 2),  # 16 groups against XLA's 14
])
def test_combined_collectives_pay_the_latency_xla_pays(strategy, mesh_axes, slack):
    # XLA's all-reduce combiner merges independent all-reduces (a gradient's do not depend on
    # each other): the cost model charges one latency per group, about as many as XLA compiles
    _, state, batch, step, plan = _plan(strategy, mesh_axes)
    compiled = automap.measure(step.lower(state, batch).compile()).collectives["all-reduce"].count
    assert abs(_latency_paid(plan, "all-reduce") - compiled) <= slack
    uncombined = sum(1 for c in plan.estimate.collectives if c.kind == "all-reduce")
    assert uncombined > 2 * compiled  # one per parameter / activation before combining
    for c in plan.estimate.collectives:  # a combined one costs only its bytes' transfer time
        if c.combined:
            from automap.cost.collectives import collective_time

            full = collective_time(c.kind, c.bytes, c.axes, mesh_axes, Topology.preset("cpu-sim")) * c.count
            assert c.time_s < full


def test_a_chain_of_dependent_collectives_is_not_combined():
    from automap.cost.combine import latency_charges

    # same kind and axes, but heights 1 and 0 (the second depends on the first): both pay
    keys = [("all-reduce", ("data",), 0, 1, 1), ("all-reduce", ("data",), 0, 1, 0), ("all-reduce", ("data",), 0, 1, 0)]
    assert latency_charges(keys, [8, 8, 8]) == [True, True, False]
    # a group pays again each time its bytes cross the combiner's threshold (30 MiB)
    assert latency_charges(keys[1:] * 2, [20 << 20] * 4) == [True, True, True, False]  # 20, 40, 60, 80 MiB
    # kinds XLA does not combine always pay
    assert latency_charges([("reduce-scatter",) + keys[1][1:]] * 2, [8, 8], ("all-reduce",)) == [True, True]


def test_parameter_gathers_of_fsdp_do_not_depend_on_each_other():
    # the gather of layer 2's kernel is an operand of a layer-2 matmul whose other operand comes
    # from layer 1: it does not depend on layer 1's gather, so all the gathers combine (GPU/TPU)
    _, _, _, _, plan = _plan("fsdp", {"data": 8})
    est = estimate(plan.state, Topology.preset("h100-8"))
    gathers = [c for c in est.collectives if c.kind == "all-gather"]
    assert len(gathers) > 4 * CFG["layers"]  # one per sharded parameter
    assert sum(not c.combined for c in gathers) == 1
