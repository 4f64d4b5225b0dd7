"""``tactics.expert_parallel``: on the corpus MoEs (GShard-style einsum dispatch, ``ragged_dot``) on a
2x4 mesh, ``schedule(data_parallel, expert_parallel)`` finds the stacked expert weights from the
contractions (not their names), splits their expert dim and their Adam moments over the axis, keeps
the routing out of it, compiles to the collectives the estimate names (all-to-all at the dispatch
and combine where the batch is split over the expert axis too) and computes the unsharded step.

``python tests/tactics/test_expert_parallel.py`` prints bytes and memory per device of
dp+expert_parallel, dp+megatron and hand-written expert-parallel plans side by side."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import tree_util
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap.zoo.corpus.moe import MoEConfig, moe_einsum, moe_ragged

MESH_AXES = {"data": 2, "model": 4}
EP = tactics.schedule(tactics.data_parallel("data"), tactics.expert_parallel("model"))
FAST = {  # XLA:CPU without optimisation passes: the SPMD partitioner (every collective) runs all the same
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
EXPERT_LEAVES = ("params/w_in", "params/w_out", "mu/w_in", "mu/w_out", "nu/w_in", "nu/w_out")
DENSE_LEAVES = ("embed", "head", "norm", "router")


def _specs(plan):
    """input path -> spec with trailing whole dims dropped and one-axis tuples unwrapped."""
    out = {}
    for path, vid in zip(plan.program.input_paths, plan.program.inputs, strict=True):
        spec = [a[0] if len(a) == 1 else (a or None) for a in plan.state.spec(vid)]
        while spec and spec[-1] is None:
            spec.pop()
        out[path] = tuple(spec)
    return out


def _run(workload, schedule):
    """(plan, measurement, sharded outputs, unsharded outputs) of one train step."""
    state, batch = workload.init(0)
    # no arbiter: the program compiled is the tactic's plan, not XLA's alternative to it
    step = automap.automap(workload.train_step, mesh=automap.make_mesh(MESH_AXES), tactics=[schedule], search=None,
                           arbiter=None)
    plan = step.plan(state, batch)
    compiled = step.lower(state, batch).compile(FAST)
    outs = compiled(*jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings)))
    got = tree_util.tree_unflatten(plan.traced.out_tree, outs)
    want = jax.jit(workload.train_step).lower(state, batch).compile(FAST)(state, batch)
    return plan, automap.measure(compiled), got, want


def _assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def _estimated_kinds(plan):
    return {c.kind for c in plan.estimate.collectives}


@pytest.mark.parametrize("batch", [4, 8], ids=["batch-on-data", "batch-on-both-axes"])
def test_expert_parallel_on_gshard_einsum_moe(batch):
    plan, measured, got, want = _run(moe_einsum(MoEConfig(batch=batch)), EP)
    specs = _specs(plan)
    for path, spec in specs.items():
        if path.endswith(EXPERT_LEAVES):  # the expert dim of the weights and of their Adam moments
            assert spec == ("model",), (path, spec)
        elif path.endswith(DENSE_LEAVES):  # the router, embedding and head: as data parallel leaves them
            assert spec == (), (path, spec)
    assert ("expert_parallel('model'): experts over batch dim 0 (4 experts) of state/params/w_in at egcd,edf->egcf"
            in plan.notes)
    # the expert-major activations: the dispatched tokens [E, G, C, D] have their expert dim on the axis
    dispatched = [v for op in plan.program.all_ops if op.name == "egcd,edf->egcf" and op.phase == "forward"
                  for v in op.inputs[:1]]
    assert [plan.state.spec(v)[0] for v in dispatched] == [("model",)]
    assert not plan.state.frozen  # the fence around the experts is lifted: later tactics may decide
    _assert_same(got, want)
    if batch == 4:  # 4 sequences cannot split over 8 devices: the tokens stay whole on 'model', no all-to-all
        assert specs["batch/tokens"] == ("data",)
        assert any("skips tokens batch/tokens" in n for n in plan.notes)
        # the embedding gradient's scatter-add takes its updates as the tokens are (no gather of them)
        assert _estimated_kinds(plan) == set(measured.collectives) == {"all-reduce"}
        assert measured.collective_bytes == sum(c.bytes * c.count for c in plan.estimate.collectives
                                                if c.kind == "all-reduce")
    else:  # GShard's layout: tokens over both axes, the dispatch and combine become all-to-alls
        assert specs["batch/tokens"] == (("data", "model"),)
        assert _estimated_kinds(plan) == set(measured.collectives) == {"all-reduce", "all-to-all"}
        a2a = [c for c in plan.estimate.collectives if c.kind == "all-to-all"]
        assert {c.module for c in a2a} == {"gsec,gsd->egcd", "gsec,egcd->gsd"}  # the dispatch and the combine
        # XLA sends the expert outputs to the tokens once for the combine and its gradient; the
        # estimate prices that all-to-all twice (5 of 4096 B against XLA's 4)
        assert measured.collectives["all-to-all"].count == 4 and len(a2a) == 5
        assert measured.collectives["all-to-all"].bytes == 4 * 4096 == 4 * a2a[0].bytes


def test_expert_parallel_on_ragged_dot_moe():
    plan, measured, got, want = _run(moe_ragged(), EP)
    specs = _specs(plan)
    for path, spec in specs.items():
        if path.endswith(EXPERT_LEAVES):
            assert spec == ("model",), (path, spec)
        elif path.endswith(DENSE_LEAVES):
            assert spec == (), (path, spec)
    assert sum("experts over group dim 0 (4 experts)" in n for n in plan.notes) == 2
    _assert_same(got, want)
    # dropless ragged_dot: each device multiplies its experts' rows, the outputs are summed over 'model'
    assert _estimated_kinds(plan) == {"all-reduce"}
    assert set(measured.collectives) == {"all-reduce", "all-gather"}  # the gather: 64 B of group sizes
    assert measured.collectives["all-reduce"].bytes == sum(c.bytes * c.count for c in plan.estimate.collectives)


def test_megatron_after_expert_parallel_splits_the_vocabulary():
    """Composed: the experts keep 'model' on their expert dim, megatron adds the vocab-parallel
    embedding and head on the same axis (the dp+expert_parallel+megatron row of the __main__ table)."""
    state, batch = moe_einsum().abstract()
    schedule = tactics.schedule(EP, tactics.megatron("model"))
    plan = automap.automap(moe_einsum().train_step, mesh=automap.make_mesh(MESH_AXES), tactics=[schedule],
                           search=None).plan(state, batch)
    specs = _specs(plan)
    assert {k[len("state/params/"):]: v for k, v in specs.items() if k.startswith("state/params/")} == {
        "embed": ("model",), "head": (None, "model"), "norm": (), "router": (), "w_in": ("model",), "w_out": ("model",)}
    assert any(n.startswith("megatron('model') skips column egcd,edf->egcf: mesh axis 'model' already tiles")
               for n in plan.notes)


def _dense(params, batch):
    return jnp.mean(jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"])


def _sgd(params, batch):
    loss, g = jax.value_and_grad(_dense)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss


def test_expert_parallel_leaves_a_dense_model_alone():
    params = {"w1": jax.ShapeDtypeStruct((16, 32), jnp.float32), "w2": jax.ShapeDtypeStruct((32, 8), jnp.float32)}
    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32)}
    plan = automap.partition(_sgd, mesh=automap.make_mesh(MESH_AXES), tactics=[tactics.expert_parallel("model")],
                             search=None).plan(params, batch)
    assert plan.notes == ("expert_parallel('model'): no expert weights (no contraction keeps a weight dim per expert: "
                          "no dot_general batch dim, no ragged_dot group dim); nothing done",)
    assert all(spec == () for spec in _specs(plan).values())


if __name__ == "__main__":
    import os
    import sys

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    rules = {"manual expert plan (batch on 'data')": P("data")}
    if batch % 8 == 0:
        rules["manual expert plan (batch on 'data','model')"] = P(("data", "model"))
    plans = {
        "dp + expert_parallel": EP,
        "dp + megatron": tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model")),
        "dp + expert_parallel + megatron": tactics.schedule(EP, tactics.megatron("model")),
        **{k: tactics.manual({r"w_in$|w_out$": P("model", None, None), r"^batch/": v}) for k, v in rules.items()},
    }
    print(f"moe_einsum MoEConfig(batch={batch}), mesh data=2 x model=4, XLA:CPU (measured per device)")
    for name, schedule in plans.items():
        _, m, got, want = _run(moe_einsum(MoEConfig(batch=batch)), schedule)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-5)  # the loss
        kinds = ", ".join(f"{k} {s.count}x/{s.bytes} B" for k, s in m.collectives.items())
        print(f"{name:46s} bytes {m.collective_bytes:7d}  wire {m.wire_bytes:9.0f}  "
              f"memory {m.memory_per_device:7d}  [{kinds}]")
