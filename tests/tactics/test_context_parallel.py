"""``tactics.context_parallel``: after ``data_parallel('data')`` on a 2x4 mesh, the zoo GPT and the corpus
Llama (grouped-query attention, rotary positions) run split on the sequence over 'model' from the tokens
to the loss: the queries, the scores (on the query, every key) and the attention output are split, the
keys and values are whole (all-gathered where they are made), the weights whole on 'model'; the step
computes the unsharded one, XLA compiles the all-gathers of the keys and values over 'model' and the
reduce-scatters of their gradients, and the estimate's bytes sent are within 10% of XLA's.

``python tests/tactics/test_context_parallel.py`` prints bytes sent and memory per device, estimated
and measured, of data parallel alone, dp+megatron and dp+context_parallel at sequence 16 and 128."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import tree_util

import automap
import tactics
from automap import zoo
from automap.zoo.corpus import LlamaConfig, llama_gqa
from tactics.flow import producers

MESH_AXES = {"data": 2, "model": 4}
SCHEDULES = {
    "dp": (tactics.data_parallel("data"),),
    "dp+megatron": (tactics.data_parallel("data"), tactics.megatron("model")),
    "dp+context_parallel": (tactics.data_parallel("data"), tactics.context_parallel("model")),
}
FAST = {  # XLA:CPU without optimisation passes: the SPMD partitioner (every collective) runs all the same
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
WORKLOADS = {
    "gpt_linen": lambda seq=16: zoo.gpt_linen(zoo.GPTConfig(layers=1, d_model=32, heads=4, vocab=64, seq=seq, batch=4)),
    "llama_gqa": lambda seq=16: llama_gqa(LlamaConfig(seq=seq)),
}
# the attention's contractions (by their einsum) and the exact specs of their operands and results
SCORES = {  # q . k: (keys or queries, the other, scores); the scores split on the query, every key
    "gpt_linen": ("bqhd,bkhd->bhqk", [(("data",), ("model",), (), ()), (("data",), (), (), ()),
                                      (("data",), (), ("model",), ())]),
    # the grouped queries are the second operand; the scores are [b, kv head, key, query, group]
    "llama_gqa": ("bqkgd,bskd->bkgqs", [(("data",), (), (), ()), (("data",), ("model",), (), (), ()),
                                        (("data",), (), (), ("model",), ())]),
}
MIX = {  # scores . v: (values, probabilities, output); the output [.., query] split on the query
    "gpt_linen": ("bhqk,bkhd->bqhd", [(("data",), (), (), ()), (("data",), (), ("model",), ()),
                                      (("data",), (), (), ("model",))]),
    "llama_gqa": ("bkgqs,bskd->bqkgd", [(("data",), (), (), ()), (("data",), (), (), ("model",), ()),
                                        (("data",), (), (), (), ("model",))]),
}
# XLA's collectives (kind: count). The gradients are all-reduced over 'model' (sequence) and 'data'
# (batch) separately, every weight's in one combined all-reduce per axis; the GPT's keys and values
# are gathered once each (the backward reuses them); the llama's values are made by a contraction
# whose result is pinned whole: XLA gathers its input (the normed stream) there
MEASURED = {
    "gpt_linen": {"all-reduce": 4, "all-gather": 2, "reduce-scatter": 1},
    "llama_gqa": {"all-reduce": 2, "all-gather": 2, "reduce-scatter": 1},
}


@functools.cache
def _run(name, schedule, seq=16):
    """(workload, plan, compiled, sharded outputs, unsharded outputs) of one train step, pinned
    program (the arbiter off: the test is about what the plan compiles to)."""
    workload = WORKLOADS[name](seq)
    state, batch = workload.init(0)
    step = automap.automap(workload.train_step, mesh=automap.make_mesh(MESH_AXES),
                           tactics=[tactics.schedule(*SCHEDULES[schedule])], search=None, arbiter=None)
    plan = step.plan(state, batch)
    compiled = step.lower(state, batch).compile(FAST)
    outs = compiled(*jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings)))
    got = tree_util.tree_unflatten(plan.traced.out_tree, outs)
    want = jax.jit(workload.train_step).lower(state, batch).compile(FAST)(state, batch)
    return workload, plan, compiled, got, want


def _contraction(plan, einsum, phase="forward"):
    return next(op for op in plan.program.all_ops
                if op.primitive == "dot_general" and op.phase == phase and op.name.endswith(einsum))


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_context_parallel_gathers_keys_and_values(name):
    workload, plan, compiled, got, want = _run(name, "dp+context_parallel")
    program, cfg = plan.program, workload.config
    assert plan.notes[-1] == ("context_parallel('model'): sequence dims of 2 data inputs and the query dims of "
                              "1 attentions; keys and values gathered")
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)  # the loss
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):  # Adam's step: see SP's test
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    # the attention: queries, scores and output split on the query; keys, values whole on 'model'
    for einsum, specs in (SCORES[name], MIX[name]):
        op = _contraction(plan, einsum)
        assert [plan.state.spec(v) for v in op.linked] == specs, einsum
    # the tokens and targets: batch on 'data', sequence on 'model'; every weight (and Adam moment) whole
    # on 'model'; the residual stream (forward, elementwise, [batch, seq, d_model]) split on the sequence
    for path, v in zip(program.input_paths, program.inputs, strict=True):
        assert plan.state.spec(v) == ((("data",), ("model",)) if path.startswith("batch/") else
                                      tuple(() for _ in program.values[v].shape)), path
    stream = [v for op in program.all_ops if op.phase == "forward" and op.primitive in ("add", "mul", "sub")
              for v in op.outputs if program.values[v].shape == (cfg.batch, cfg.seq, cfg.d_model)]
    assert len(stream) >= 5
    assert {plan.state.spec(v) for v in stream} == {(("data",), ("model",), ())}
    assert not plan.state.frozen  # the fence is lifted

    # XLA's collectives: the keys' and values' all-gathers and their gradients' reduce-scatter over 'model'
    measured = automap.measure(compiled)
    assert {k: s.count for k, s in measured.collectives.items()} == MEASURED[name]
    assert {o.group_size for o in measured.ops if o.kind in ("all-gather", "reduce-scatter")} == {4}  # 'model'
    estimated = [c for c in plan.estimate.collectives if c.axes == ("model",)]
    assert sorted(c.kind for c in estimated if c.kind != "all-reduce") == [
        "all-gather", "all-gather", "reduce-scatter", "reduce-scatter"]
    # the estimate's gathers are at the ops making the keys and the values (the llama's values are
    # made by a contraction: its input is gathered, as XLA does), their gradients scattered at the
    # backward contractions with the scores
    whole = [v for einsum in (SCORES[name][0], MIX[name][0]) for v in _contraction(plan, einsum).linked_inputs
             if not any("model" in axes for axes in plan.state.spec(v))]  # the keys, the values
    made = producers(program)
    assert sorted(c.op for c in estimated if c.kind == "all-gather") == sorted(made[v].id for v in whole)
    assert all(c.op in {op.id for op in program.all_ops if op.phase == "backward"}
               for c in estimated if c.kind == "reduce-scatter")
    fidelity = plan.verify(compiled, warn=False)
    assert fidelity.bytes_sent.ratio == pytest.approx(1.0, abs=0.1), str(fidelity)
    # the gathers and scatters are XLA's, byte for byte
    for kind in ("all-gather", "reduce-scatter"):
        assert measured.collectives[kind].bytes == sum(c.bytes * c.count for c in estimated if c.kind == kind), kind


def test_context_parallel_beside_megatron():
    """dp + megatron on 'tensor' (heads, MLP hidden) + context parallelism on 'context', mesh 2x2x2: the
    attention is split on the batch, the heads and the query at once; the keys and values are whole on
    'context' alone; the step is the unsharded one and the estimate's bytes are XLA's (within 2%)."""
    workload = WORKLOADS["gpt_linen"]()
    state, batch = workload.init(0)
    schedule = tactics.schedule(tactics.data_parallel("data"), tactics.megatron("tensor"),
                                tactics.context_parallel("context"))
    step = automap.automap(workload.train_step, mesh=automap.make_mesh({"data": 2, "tensor": 2, "context": 2}),
                           tactics=[schedule], search=None, arbiter=None)
    plan = step.plan(state, batch)
    scores = _contraction(plan, SCORES["gpt_linen"][0])
    assert [plan.state.spec(v) for v in scores.linked] == [
        (("data",), ("context",), ("tensor",), ()), (("data",), (), ("tensor",), ()),
        (("data",), ("tensor",), ("context",), ())]
    compiled = step.lower(state, batch).compile(FAST)
    outs = compiled(*jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings)))
    got = tree_util.tree_unflatten(plan.traced.out_tree, outs)
    np.testing.assert_allclose(got[1], jax.jit(workload.train_step)(state, batch)[1], rtol=1e-5)
    fidelity = plan.verify(compiled, warn=False)
    assert fidelity.bytes_sent.ratio == pytest.approx(1.0, abs=0.02), str(fidelity)
    assert {(r.kind, r.axes) for r in fidelity.collectives if r.measured_count} == {
        ("all-reduce", ("context",)), ("all-reduce", ("data",)), ("all-reduce", ("tensor",)),
        ("all-gather", ("context",)), ("reduce-scatter", ("context",))}


def _tiny_step(mix_tokens: bool, attention: bool = True):
    def loss(w, x):  # x: (batch, seq, features)
        y = x @ w["up"]
        if attention:
            q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
            p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)
            y = y + jnp.einsum("bqk,bkd->bqd", p, v)
        if mix_tokens:  # an MLP-Mixer token mixing: the sequence contracted with a weight
            y = jnp.einsum("bsd,st->btd", y, w["tokens"])
        return (y * y).sum()

    def step(w, x):
        value, g = jax.value_and_grad(loss)(w, x)
        return jax.tree.map(lambda a, b: a - 0.1 * b, w, g), value

    w = {k: jnp.ones((4, 4)) for k in ("up", "q", "k", "v")} | {"tokens": jnp.ones((8, 8))}
    return step, w, jnp.ones((2, 8, 4))


@pytest.mark.parametrize("mix_tokens, attention, reason", [
    (True, True, "the sequence dim of x is contracted with a weight at dot_general bsd,st->btd"),
    (False, False, "no attention (no contraction of two activations holds the sequence dim twice)"),
])
def test_context_parallel_refuses_where_attention_does_not_allow_it(mix_tokens, attention, reason):
    step, w, x = _tiny_step(mix_tokens, attention)
    schedule = tactics.schedule(tactics.data_parallel("data"), tactics.context_parallel("model"))
    plan = automap.partition(step, mesh=automap.make_mesh(MESH_AXES), tactics=[schedule], search=None).plan(w, x)
    note = plan.notes[-1]
    assert note.startswith(f"context_parallel('model'): attention does not allow it ({reason}")
    assert note.endswith("; nothing done")
    assert not any("model" in axes for spec in plan.state.specs.values() for axes in spec)
    # without the token mixing, the same attention is split
    if attention:
        step, w, x = _tiny_step(False)
        plan = automap.partition(step, mesh=automap.make_mesh(MESH_AXES), tactics=[schedule], search=None).plan(w, x)
        assert plan.state.spec(plan.program.inputs[-1]) == (("data",), ("model",), ())


if __name__ == "__main__":
    import os

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    print("mesh data=2 x model=4, XLA:CPU, pinned programs; per device: bytes sent and memory, estimated / XLA")
    for name in WORKLOADS:
        for seq in (16, 128):
            for schedule in SCHEDULES:
                _, plan, compiled, got, want = _run(name, schedule, seq)
                np.testing.assert_allclose(got[1], want[1], rtol=1e-5)  # the loss
                f = plan.verify(compiled, warn=False)
                print(f"{name:9s} seq {seq:3d} {schedule:20s} sent {f.bytes_sent.estimated / 1024:8.1f} / "
                      f"{f.bytes_sent.measured / 1024:8.1f} KiB ({f.bytes_sent.ratio:.2f})   memory "
                      f"{f.memory.estimated / 1024:8.1f} / {f.memory.measured / 1024:8.1f} KiB ({f.memory.ratio:.2f})")
