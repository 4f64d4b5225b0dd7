"""Recomputing blocks after differentiation (automap/ir/recompute.py): the replayed program gives
the unsharded step's numbers, XLA's measured memory drops as the estimate says, and the
recomputed FLOPs are priced."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools

import jax
import numpy as np
import pytest

import automap
import tactics
from automap import _compat, emit, zoo
from automap.cost import estimate
from automap.ir.recompute import recompute_state, repeated_blocks

# activations outweigh the parameters, as in training at scale
CFG = zoo.GPTConfig(layers=2, batch=16, seq=32, vocab=64)


@functools.lru_cache(maxsize=None)
def _gpt():
    w = zoo.gpt_linen(CFG)
    state, batch = w.init(0)
    return w, state, batch


@functools.lru_cache(maxsize=None)
def _dp_plan():
    w, state, batch = _gpt()
    mesh = automap.make_mesh({"data": 2, "model": 4})
    step = automap.partition(w.train_step, mesh=mesh, tactics=[tactics.data_parallel("data")], search=None)
    return mesh, step.plan(state, batch)


def _run(state, mesh):
    w, params, batch = _gpt()
    flat = jax.tree.leaves((params, batch))
    jitted = emit.compile_plan(state, _compat.auto_view(mesh), pins=emit.pinned_values(state, "plan"))
    return automap.measure(jitted.lower(*flat).compile()), jitted(*flat)


def test_repeated_blocks_are_the_layers():
    _, plan = _dp_plan()
    assert repeated_blocks(plan.program) == ("GPT/blocks_0", "GPT/blocks_1")


def test_recomputed_gpt_equals_the_unsharded_step_and_holds_less_memory():
    mesh, plan = _dp_plan()
    blocks = repeated_blocks(plan.program)
    rstate = recompute_state(plan.state, blocks)
    assert rstate.program.recomputed == blocks
    est_kept, est_redone = estimate(plan.state), estimate(rstate)
    kept, outs = _run(plan.state, mesh)
    redone, routs = _run(rstate, mesh)
    w, params, batch = _gpt()
    want = jax.tree.leaves(jax.jit(w.train_step)(params, batch))
    np.testing.assert_allclose(routs[-1], want[-1], rtol=1e-5)  # the loss
    for got, ref in zip(routs, want, strict=True):  # the new state, as tests/automap/test_gpt_plans.py holds it
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-4)
    # the residuals die with the forward: XLA's temporaries and the estimate's drop
    assert redone.memory.temp < 0.75 * kept.memory.temp  # 3,348,856 -> 2,097,528 B
    assert est_redone.memory.temp < 0.75 * est_kept.memory.temp
    assert redone.memory.argument == kept.memory.argument and redone.memory.output == kept.memory.output
    # the blocks' forward matmuls run twice: priced as XLA counts them
    assert redone.dot_flops - kept.dot_flops == pytest.approx(est_redone.dot_flops - est_kept.dot_flops, rel=1e-6)
    assert redone.dot_flops > kept.dot_flops and est_redone.time_s > est_kept.time_s


def test_recompute_skips_what_is_not_a_block_and_is_idempotent():
    _, plan = _dp_plan()
    assert recompute_state(plan.state, ["GPT/nowhere"]) is plan.state
    once = recompute_state(plan.state, ["GPT/blocks_1"])
    assert recompute_state(once, ["GPT/blocks_1"]) is once
    assert once.program.recomputed == ("GPT/blocks_1",)
