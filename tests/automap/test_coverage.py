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


# ---------------------------------------------------------------------------------------------
# every primitive JAX registers: a hand-written rule, a rule derived from XLA, or a reason


def registered_primitives():
    """name -> Primitive for the Primitive objects of JAX's public modules."""
    import jax.extend.core.primitives
    import jax.lax.linalg
    import jax.random

    found = {}
    for module in (jax.extend.core.primitives, jax.lax, jax.lax.linalg, jax.random):
        for attr in dir(module):
            p = getattr(module, attr)
            if isinstance(p, jax.extend.core.Primitive):
                found.setdefault(p.name, p)
    return found


def battery_equations():
    """name -> the first equation of that primitive in the battery's jaxprs (and their grads)."""
    import jax.experimental.shard_alike  # noqa: F401  (the battery uses it)
    from primitive_battery import BATTERY, NO_GRAD

    calls = []
    for fn, args in BATTERY.values():
        floats = tuple(i for i, a in enumerate(args) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating))
        summed = lambda *a, fn=fn: jax.numpy.sum(fn(*a))  # noqa: E731
        calls += [(fn, args)] + ([(jax.grad(summed, argnums=floats), args)] if floats else [])
    calls += list(NO_GRAD.values())
    found = {}
    for fn, args in calls:
        stack = [jax.make_jaxpr(fn)(*args).jaxpr]
        while stack:
            jaxpr = stack.pop()
            for eqn in jaxpr.eqns:
                found.setdefault(eqn.primitive.name, eqn)
                stack.extend(jax.extend.core.jaxprs_in_params(eqn.params))
    return found


def _context(eqn):
    shaped = lambda vs: tuple(rules.Shaped(tuple(v.aval.shape), v.aval.dtype) for v in vs)  # noqa: E731
    return rules.RuleContext(eqn.primitive.name, shaped(eqn.invars), shaped(eqn.outvars))


def test_every_primitive_has_a_rule_a_derivation_or_a_reason(capsys):
    registered = registered_primitives()
    equations = battery_equations()
    names = set(registered) | set(equations)
    hand = {p for p in names if rules.covered(p)}
    documented = {p for p in names - hand if p in rules.UNREACHABLE}
    derived, failed, unexplained = set(), {}, set()
    for p in sorted(names - hand - documented):
        eqn = equations.get(p)
        if eqn is None:
            unexplained.add(p)  # registered, never seen: give it a rule or a reason in UNREACHABLE
            continue
        got = rules.derive_rule(eqn.primitive, _context(eqn), eqn.params)
        if got.rule is None:
            failed[p] = got.reason
        else:
            derived.add(p)
    with capsys.disabled():
        print(f"\nprimitives: {len(registered)} registered in jax.extend.core.primitives / jax.lax / "
              f"jax.lax.linalg / jax.random, {len(equations)} in the battery's jaxprs, {len(names)} in all; "
              f"{len(hand)} hand-written or structural ({len(hand & set(rules.UNSHARDABLE))} of them kept whole "
              f"with a reason), {len(derived)} derived from XLA {sorted(derived)}, {len(documented)} unreachable "
              f"with a reason")
    assert not unexplained, f"registered primitives with no rule, no example to derive one and no reason: {sorted(unexplained)}"
    assert not failed, f"primitives whose rule could not be derived: {failed}"
    assert len(equations) >= 120 and len(registered) >= 180


def test_the_reasons_are_not_stale():
    """A primitive that has a rule needs no reason; every reason is a sentence."""
    assert not set(rules.UNREACHABLE) & set(rules.RULES)
    assert all(len(why.split()) >= 4 for why in {**rules.UNSHARDABLE, **rules.UNREACHABLE}.values())
