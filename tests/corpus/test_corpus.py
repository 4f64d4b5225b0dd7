"""automap on third-party model code (``automap.zoo.corpus``): flax nnx and linen layers, equinox
layers, a Llama-style GQA decoder, two mixture-of-experts layers and a ViT, on a data=2 x model=4
mesh. For every model: the default plan and the tactics plans compute the unsharded step and
raise no `MissingRuleWarning`; ``data_parallel`` splits the batch inputs' leading dim;
``schedule(data_parallel, megatron)`` gives every column/row projection pair, the vocab-parallel
embedding and head their Megatron specs."""
import functools
import time
import warnings

import jax
import numpy as np
import pytest
from jax import tree_util

import automap
import search
import tactics
from automap.rules import MissingRuleWarning
from automap.zoo import corpus
from automap.zoo.corpus.megatron_specs import MEGATRON

MESH = automap.make_mesh({"data": 2, "model": 4})
DP = tactics.data_parallel("data")
TP = tactics.schedule(DP, tactics.megatron("model"))
# tactics plans run without a search filling the axes they leave (that is the default plan's job)
PLANS = {
    "default": dict(search=search.MCTS(episodes=8, seed=0)),
    "data_parallel": dict(tactics=[DP], search=None),
    "megatron": dict(tactics=[TP], search=None),
    "fsdp": dict(tactics=[tactics.fsdp("data")], search=None),
}
# XLA:CPU compiles these tiny programs several times faster without optimisation passes
FAST = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
# model -> (expected Megatron specs by parameter path under state/params/, why it fails today)
MODELS = {name: (specs, None) for name, specs in MEGATRON.items()}

# model -> column/row pairs megatron reports (attention + MLP per block; the MoE's expert MLP)
PAIRS = {"nnx_transformer": 2, "linen_resnet": 0, "eqx_transformer": 2, "llama_gqa": 2, "moe_ragged": 1,
         "moe_einsum": 1, "linen_vit": 2}

# models whose step mixes the examples of the batch: the ragged MoE sorts the tokens of the whole
# batch by expert (one global argsort), so no input dim reaches the loss untouched by the sort
WHOLE_BATCH = {"moe_ragged"}


def _rows(ids):
    return [pytest.param(*i, marks=pytest.mark.xfail(reason=MODELS[i[0]][1], strict=True) if MODELS[i[0]][1] else (),
                         id="-".join(i)) for i in ids]


@functools.cache
def _workload(name):
    w = corpus.BUILDERS[name]()
    return w, w.init(0)


@functools.cache
def _reference(name):
    w, (state, batch) = _workload(name)
    return jax.jit(w.train_step).lower(state, batch).compile(FAST)(state, batch)


@functools.cache
def _plan(name, plan_name):
    """(the Partitioned step, its plan, plan seconds); a MissingRuleWarning is an error. Planned
    once per module run: both tests read the tactics plans."""
    w, (state, batch) = _workload(name)
    step = automap.automap(w.train_step, mesh=MESH, **PLANS[plan_name])
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingRuleWarning)
        start = time.perf_counter()
        plan = step.plan(state, batch)
    return step, plan, time.perf_counter() - start


def _norm(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries)


def _specs(plan, prefix):
    program = plan.program
    return {path[len(prefix):]: _norm(plan.state.partition_spec(v), program.values[v].ndim)
            for path, v in zip(program.input_paths, program.inputs, strict=True) if path.startswith(prefix)}


@pytest.mark.parametrize("name, plan_name", _rows([(m, p) for m in MODELS for p in PLANS]))
def test_plan_computes_the_unsharded_step(name, plan_name, record_property):
    w, (state, batch) = _workload(name)
    step, plan, seconds = _plan(name, plan_name)
    record_property("plan_seconds", round(seconds, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingRuleWarning)
        compiled = step.lower(state, batch).compile(FAST)
    outs = compiled(*jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings)))
    (new_state, loss), (want_state, want_loss) = tree_util.tree_unflatten(plan.traced.out_tree, outs), _reference(name)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    # Adam divides by the gradient's size: a gradient that is zero in exact arithmetic (a key bias:
    # softmax ignores a constant shift) is rounding noise, normalised to up to 1e-6 here
    got_leaves = tree_util.tree_flatten_with_path(new_state)[0]
    for (path, got), want in zip(got_leaves, jax.tree.leaves(want_state), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=tree_util.keystr(path))


@pytest.mark.parametrize("name", _rows([(m,) for m in MODELS]))
def test_tactics_find_the_batch_and_the_megatron_pairs(name):
    w, (state, batch) = _workload(name)
    _, dp, _ = _plan(name, "data_parallel")
    batch_specs = _specs(dp, "batch/")
    if name in WHOLE_BATCH:  # the program mixes the examples: data_parallel says so and splits nothing
        assert all(set(s) == {None} for s in batch_specs.values()), batch_specs
        assert any("no data input has a batch dim" in n for n in dp.notes), dp.notes
    else:
        assert batch_specs == {k: ("data",) + (None,) * (len(v) - 1) for k, v in batch_specs.items()}, dp.notes

    _, tp, _ = _plan(name, "megatron")
    want, _ = MODELS[name]
    params = _specs(tp, "state/params/")
    got = {path: params[path] for path in want}
    assert got == {path: _norm(s, len(params[path])) for path, s in want.items()}, "\n".join(tp.notes)
    # the report names one column/row pair per attention and per MLP
    assert sum(" paired with row " in n for n in tp.notes) == PAIRS[name], "\n".join(tp.notes)
