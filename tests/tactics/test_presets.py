"""Presets are compositions: the same plans as the schedules they name, the expert FSDP+TP specs
on the zoo GPT, and the unsharded numerics."""
import jax
import numpy as np
import pytest
from jax import tree_util
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import zoo

GPT = dict(layers=2, d_model=32, heads=4, vocab=64, seq=16, batch=8)


def _norm(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries)


def _specs(w, mesh, tactic):
    plan = automap.automap(w.train_step, mesh=mesh, tactics=[tactic]).plan(*w.abstract())
    return {v: plan.state.spec(v) for v in range(len(plan.program.values))}


# preset, the schedule it stands for, mesh
SAME = [
    (tactics.megatron_dp(), tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model")),
     {"data": 2, "model": 4}),
    (tactics.fsdp_tp(), tactics.schedule(tactics.data_parallel(), tactics.megatron(), tactics.fsdp()),
     {"data": 2, "model": 4}),
    (tactics.zero_dp(2), tactics.schedule(tactics.data_parallel(), tactics.zero(2)), {"data": 8}),
    (tactics.fsdp_only(), tactics.fsdp("data"), {"data": 8}),
]


@pytest.mark.parametrize("preset,composed,axes", SAME, ids=["megatron_dp", "fsdp_tp", "zero_dp", "fsdp_only"])
def test_preset_is_its_composition(preset, composed, axes):
    w = zoo.gpt_linen(zoo.GPTConfig(scan=True, **GPT))
    mesh = automap.make_mesh(axes)
    assert _specs(w, mesh, preset) == _specs(w, mesh, composed)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_fsdp_tp_matches_expert_specs(scan):
    w = zoo.gpt_linen(zoo.GPTConfig(scan=scan, **GPT))
    state, batch = w.abstract()
    mesh = automap.make_mesh({"data": 2, "model": 4})
    plan = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.fsdp_tp()]).plan(state, batch)
    program = plan.program
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    expert = tree_util.tree_leaves(zoo.experts.fsdp_megatron(state, batch, mesh), is_leaf=is_spec)
    megatron = tree_util.tree_leaves(zoo.experts.megatron(state, batch, mesh), is_leaf=is_spec)
    tp = 0
    for path, vid, want, tp_want in zip(program.input_paths, program.inputs, expert, megatron, strict=True):
        ndim = program.values[vid].ndim
        got = _norm(plan.state.partition_spec(vid), ndim)
        assert got == _norm(want, ndim), path  # every leaf, optimizer state and batch included
        if "model" in _norm(tp_want, ndim) and path.startswith("state/params/") and not path.endswith("bias"):
            tp += 1
            assert "data" in got, path  # a kernel megatron shards also gets one dim on `data`
    assert tp >= (6 if scan else 10)


def test_fsdp_tp_numerics():
    w = zoo.gpt_linen(zoo.GPTConfig(scan=False, **GPT))
    state, batch = w.init(0)
    mesh = automap.make_mesh({"data": 2, "model": 4})
    step = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.fsdp_tp()])
    plan = step.plan(state, batch)
    compiled = step.lower(state, batch).compile()  # compile once: run what was lowered
    loss = compiled(*jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings)))[-1]
    np.testing.assert_allclose(loss, jax.jit(w.loss_fn)(state["params"], batch), rtol=1e-5)
