"""``tactics.sequence_parallel``: after ``data_parallel('data')`` and ``megatron('model')`` on a 2x4 mesh,
the layer-norm and residual regions of the zoo GPT and of the corpus Llama take the sequence dim over
'model', the weights keep megatron's specs, the step computes the unsharded one, and XLA compiles the
row projections' all-reduces as reduce-scatters and the column projections' inputs as all-gathers over
'model', with the bytes the estimate names.

``python tests/tactics/test_sequence_parallel.py`` prints bytes sent, memory per device and the estimated
step time of dp+megatron and dp+megatron+sequence_parallel side by side."""
import functools

import jax
import numpy as np
import pytest
from jax import tree_util

import automap
import tactics
from automap import zoo
from automap.zoo.corpus import LlamaConfig, llama_gqa

MESH_AXES = {"data": 2, "model": 4}
TP = (tactics.data_parallel("data"), tactics.megatron("model"))
SP = TP + (tactics.sequence_parallel("model"),)
FAST = {  # XLA:CPU without optimisation passes: the SPMD partitioner (every collective) runs all the same
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
WORKLOADS = {
    "gpt_linen": lambda: zoo.gpt_linen(zoo.GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq=16, batch=4)),
    "llama_gqa": lambda: llama_gqa(LlamaConfig(seq=16)),
}
# also in the table `python tests/tactics/test_sequence_parallel.py` prints: a scanned model
REPORTED = {**WORKLOADS, "gpt_nnx_scan": lambda: zoo.gpt_nnx(
    zoo.GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq=16, batch=4, scan=True))}
# (measured kinds: counts) of dp+megatron and of dp+megatron+sequence_parallel. XLA gathers a
# column-input gradient's partial sums of the q/k/v (and gate/up) projections into one reduce-scatter,
# so the llama has fewer reduce-scatters than the estimate (same bytes)
MEASURED = {
    "gpt_linen": ({"all-reduce": 14}, {"all-reduce": 7, "all-gather": 10, "reduce-scatter": 9}),
    "llama_gqa": ({"all-reduce": 12}, {"all-reduce": 8, "all-gather": 6, "reduce-scatter": 5}),
}
ELEMENTWISE = {"add", "add_any", "sub", "mul", "div", "square", "rsqrt", "integer_pow", "neg"}


@functools.cache
def _run(name, sequence):
    """(plan, measurement, sharded outputs, unsharded outputs) of one train step, pinned program
    (the arbiter off: the test is about what the plan compiles to)."""
    workload = REPORTED[name]()
    state, batch = workload.init(0)
    step = automap.automap(workload.train_step, mesh=automap.make_mesh(MESH_AXES),
                           tactics=[tactics.schedule(*(SP if sequence else TP))], search=None, arbiter=None)
    plan = step.plan(state, batch)
    compiled = step.lower(state, batch).compile(FAST)
    outs = compiled(*jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings)))
    got = tree_util.tree_unflatten(plan.traced.out_tree, outs)
    want = jax.jit(workload.train_step).lower(state, batch).compile(FAST)(state, batch)
    return workload, plan, automap.measure(compiled), got, want


def _input_specs(plan):
    return {path: plan.state.spec(v) for path, v in zip(plan.program.input_paths, plan.program.inputs, strict=True)}


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_sequence_parallel_between_megatron_regions(name):
    workload, plan, measured, got, want = _run(name, True)
    _, tp_plan, tp_measured, _, _ = _run(name, False)
    cfg = workload.config
    stream = (cfg.batch, cfg.seq, cfg.d_model)
    # the layer norms and residual adds (forward, elementwise, shaped like the residual stream): sequence on 'model'
    region = [v for op in plan.program.all_ops if op.phase == "forward" and op.primitive in ELEMENTWISE
              for v in op.outputs if plan.program.values[v].shape == stream]
    assert len(region) >= 10
    assert {plan.state.spec(v) for v in region} == {(("data",), ("model",), ())}
    assert {tp_plan.state.spec(v) for v in region} == {(("data",), (), ())}
    # every input (weights, Adam moments, tokens) keeps its dp+megatron spec; the fence is lifted
    assert _input_specs(plan) == _input_specs(tp_plan)
    assert not plan.state.frozen
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)  # the loss
    # the updated state: Adam's first step moves a weight by about the learning rate (1e-3) whatever
    # its gradient's size, so round-off in a tiny gradient shows at 1e-6 (as under dp+megatron alone)
    for g, w in zip(jax.tree.leaves(got[0]), jax.tree.leaves(want[0]), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    # the collectives: megatron's all-reduces over 'model' become reduce-scatters and all-gathers
    tp_kinds, sp_kinds = MEASURED[name]
    assert {k: s.count for k, s in tp_measured.collectives.items()} == tp_kinds
    assert {k: s.count for k, s in measured.collectives.items()} == sp_kinds
    assert {o.group_size for o in measured.ops if o.kind in ("reduce-scatter", "all-gather")} == {4}  # 'model'
    estimated = [c for c in plan.estimate.collectives if c.axes == ("model",)]
    assert {c.kind for c in estimated} == {"all-reduce", "all-gather", "reduce-scatter"}
    assert not {c.kind for c in tp_plan.estimate.collectives} & {"reduce-scatter"}

    # the bytes of the reduce-scatters and all-gathers: the estimate's are XLA's
    for kind in ("reduce-scatter", "all-gather"):
        assert measured.collectives[kind].bytes == sum(c.bytes * c.count for c in estimated if c.kind == kind), kind
    # the vocab-parallel embedding keeps megatron's all-reduce (split on the sequence, XLA gathers the table)
    table = next(v for path, v in zip(plan.program.input_paths, plan.program.inputs, strict=True)
                 if path.endswith(("params/wte/embedding", "params/embed")))
    lookup = next(op for op in plan.program.all_ops if op.primitive == "gather" and op.inputs[0] == table)
    assert [c.kind for c in estimated if c.op == lookup.id] == ["all-reduce"]
    assert plan.state.spec(lookup.outputs[0]) == (("data",), (), ())


def test_sequence_parallel_needs_tensor_parallelism_on_its_axis():
    workload = WORKLOADS["gpt_linen"]()
    state, batch = workload.abstract()
    schedule = tactics.schedule(tactics.data_parallel("data"), tactics.sequence_parallel("model"))
    plan = automap.automap(workload.train_step, mesh=automap.make_mesh(MESH_AXES), search=None,
                           tactics=[schedule]).plan(state, batch)
    assert plan.notes[-1] == "sequence_parallel('model'): every sequence dim skipped; nothing done"
    assert ("sequence_parallel('model') skips column input GPT/blocks_0/ln1/add: "
            "state/params/blocks_0/attn/qkv/kernel is not tensor-parallel on 'model' (put megatron('model') before it)"
            ) in plan.notes
    assert not any("model" in axes for spec in plan.state.specs.values() for axes in spec)


def test_scan_results_are_pinned_as_planned():
    """Scanned nnx GPT: sequence parallelism decides values the backward ``scan`` returns (the
    embedding's gradient among them); emission pins them, so XLA compiles the planned layout (the
    bytes it sends within 2% of the estimate; unpinned, XLA gathered the table: 1.18x)."""
    workload = REPORTED["gpt_nnx_scan"]()
    state, batch = workload.init(0)
    schedule = tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model"), tactics.sequence_parallel("model"))
    step = automap.automap(workload.train_step, mesh=automap.make_mesh(MESH_AXES), tactics=[schedule], search=None,
                           arbiter=None)
    plan = step.plan(state, batch)
    scans = [op for op in plan.program.ops if op.primitive == "scan"]
    assert any(set(op.outputs) & plan.pins for op in scans)
    measured = automap.measure(step.lower(state, batch).compile(FAST))
    assert measured.wire_bytes == pytest.approx(plan.estimate.wire_bytes, rel=0.02)


if __name__ == "__main__":
    import os

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    print("mesh data=2 x model=4, XLA:CPU, pinned programs (measured per device; time: the estimate)")
    for name in REPORTED:
        for sequence in (False, True):
            _, plan, m, got, want = _run(name, sequence)
            np.testing.assert_allclose(got[1], want[1], rtol=1e-5)  # the loss
            label = f"{name} dp+megatron" + ("+sequence_parallel" if sequence else "")
            kinds = ", ".join(f"{k} {s.count}x/{s.bytes} B" for k, s in m.collectives.items())
            print(f"{label:42s} wire {m.wire_bytes:9.0f}  bytes {m.collective_bytes:7d}  "
                  f"memory {m.memory_per_device:7d}  est {plan.estimate.time_s * 1e3:.3f} ms  [{kinds}]")
