"""Primitive coverage: every zoo train step lowers in strict mode (every primitive has a rule)."""
import jax
import numpy as np
import optax
import pytest

import automap
from automap import rules, zoo

TINY = dict(vocab=32, seq=8, d_model=16, heads=2, layers=2, batch=4)
VARIANTS = {
    "linen": lambda: zoo.gpt_linen(zoo.GPTConfig(**TINY)),
    "linen_scan": lambda: zoo.gpt_linen(zoo.GPTConfig(scan=True, **TINY)),
    "linen_remat": lambda: zoo.gpt_linen(zoo.GPTConfig(remat=True, **TINY)),
    "linen_scan_remat": lambda: zoo.gpt_linen(zoo.GPTConfig(scan=True, remat=True, **TINY)),
    "linen_gated_sepqkv": lambda: zoo.gpt_linen(zoo.GPTConfig(gated_mlp=True, separate_qkv=True, **TINY)),
    "linen_dropout_scan": lambda: zoo.gpt_linen(zoo.GPTConfig(dropout=0.1, scan=True, **TINY)),
    "linen_dropout": lambda: zoo.gpt_linen(zoo.GPTConfig(dropout=0.1, **TINY)),
    "nnx": lambda: zoo.gpt_nnx(zoo.GPTConfig(**TINY)),
    "nnx_scan_remat": lambda: zoo.gpt_nnx(zoo.GPTConfig(scan=True, remat=True, **TINY)),
    "nnx_dropout": lambda: zoo.gpt_nnx(zoo.GPTConfig(dropout=0.1, **TINY)),
    "mlp": lambda: zoo.mlp(zoo.MLPConfig(d_in=8, hidden=(16,), d_out=4, batch=4)),
}


def multisteps_mlp():
    """The zoo MLP under optax.MultiSteps (gradient accumulation: a `cond` in the step)."""
    w = zoo.mlp(zoo.MLPConfig(d_in=8, hidden=(16,), d_out=4, batch=4))
    opt = optax.MultiSteps(zoo.make_optimizer(1e-2), every_k_schedule=2)
    step = zoo.make_train_step(w.loss_fn, opt)
    state, batch = w.init(0)
    state = {"params": state["params"], "opt_state": opt.init(state["params"])}
    return step, state, batch


def _lower_strict(fn, args):
    t = automap.trace(fn, args)
    return automap.lower(t.closed_jaxpr, t.in_paths, t.out_paths, strict=True)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_zoo_variant_lowers_in_strict_mode(name):
    w = VARIANTS[name]()
    program = _lower_strict(w.train_step, w.abstract())
    assert all(op.has_rule for op in program.all_ops)
    assert all(rules.covered(p) for p in program.primitives())
    if "scan" in name:
        assert sum(op.primitive == "scan" for op in program.all_ops) == 2  # forward and its transpose


def test_multisteps_cond_lowers_and_runs_sharded():
    step, state, batch = multisteps_mlp()
    program = _lower_strict(step, (state, batch))
    conds = [op for op in program.all_ops if op.primitive == "cond"]
    assert conds and all(len(op.regions) == 2 for op in conds)
    mesh = automap.make_mesh({"data": 2, "model": 4})
    sharded = automap.automap(step, mesh=mesh)
    ref = jax.jit(step)
    s1, s2 = state, state
    for _ in range(3):  # the cond takes both branches
        s1, loss = sharded(s1, batch)
        s2, ref_loss = ref(s2, batch)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_every_primitive_in_the_zoo_has_a_rule():
    seen = set()
    for make in VARIANTS.values():
        w = make()
        closed = jax.make_jaxpr(w.train_step)(*w.abstract())
        stack = [closed.jaxpr]
        while stack:
            jaxpr = stack.pop()
            for eqn in jaxpr.eqns:
                seen.add(eqn.primitive.name)
                for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                    stack.append(sub)
    missing = sorted(p for p in seen if not rules.covered(p))
    assert not missing, f"primitives without a factor rule: {missing}"
    assert len(seen) >= 45
