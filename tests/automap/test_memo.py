"""The memoised fast paths give exactly what the plain algorithms give.

Propagation solves factors through a memo that leaves priorities out of the key where they
cannot matter, and writes precomputed updates; the cost model reuses an ancestor's per-op
analysis, derives state keys incrementally and sums op costs with numpy. Each is checked here
against the straightforward computation, on random decision sequences (with real conflicts:
several decisions on one mesh axis) over programs with a backward pass, a value used twice
(``x * x``), a scan and the zoo GPT.
"""
import collections
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from automap import zoo
from automap.analysis import op_analyses
from automap.cost import estimate
from automap.factors import SOLVED, Solution, solution, solve_factors
from automap.ir.lower import lower
from automap.propagate import _project_in_order, apply
from automap.shardings import Action, ShardingError, ShardingState
from automap.trace import trace

AXES = {"data": 2, "model": 4}


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _program(fn, *args):
    t = trace(fn, args)
    return lower(t.closed_jaxpr, t.in_paths, t.out_paths)


def _mlp_step(w1, w2, x):
    def loss(w1, w2):
        return (jnp.tanh(x @ w1) @ w2).sum()

    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def _square_then_matmul(x, w):
    return (x * x) @ w + x @ w  # x is linked twice by the multiply


def _scan(w, xs):
    def body(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h.sum(axis=1)

    return lax.scan(body, jnp.zeros((8, 16)), xs)


def _gpt():
    w = zoo.gpt_linen(zoo.GPTConfig(layers=2, scan=False, d_model=32, heads=4, vocab=64, seq=16, batch=8))
    state, batch = w.abstract()
    return _program(w.train_step, state, batch)


PROGRAMS = {
    "mlp_step": lambda: _program(_mlp_step, sds(16, 32), sds(32, 8), sds(8, 16)),
    "square": lambda: _program(_square_then_matmul, sds(8, 16), sds(16, 8)),
    "scan": lambda: _program(_scan, sds(16, 16), sds(4, 8, 16)),
    "gpt": _gpt,
}


# ---------------------------------------------------------------------------------------------
# the plain algorithms: solve every op afresh, write as the loop goes


def _reference_project(op, state, specs, prio, frozen):
    """Solve the op afresh and write each linked value in turn (propagation's loop without the memo)."""
    fax, fprio = solve_factors(op, state, specs, prio)
    return _project_in_order(op, fax, fprio, state.axes, specs, prio, frozen) if fax else []


def _reference_apply(state, actions, label):
    specs, prio = dict(state.specs), dict(state.priority)
    p = state.next_priority
    for action in actions:
        spec = list(state.spec(action.value))
        spec[action.dim] += (action.axis,)
        specs[action.value] = tuple(spec)
        prio[(action.value, action.dim)] = p
    program = state.program
    queue, queued = collections.deque(), set()

    def push(vid):
        for op in program.users.get(vid, ()):
            if op.id not in queued:
                queued.add(op.id)
                queue.append(op)

    for a in actions:
        push(a.value)
    budget = 64 * (len(program.all_ops) + 1)
    while queue and budget:
        budget -= 1
        op = queue.popleft()
        queued.discard(op.id)
        for vid in _reference_project(op, state, specs, prio, state.frozen):
            push(vid)
    return specs, prio


def _random_actions(state, rng, n):
    """A group of up to ``n`` legal actions on random inputs and intermediates."""
    program = state.program
    out = []
    for _ in range(8 * n):
        vid = int(rng.choice(program.inputs)) if rng.random() < 0.7 else int(rng.integers(len(program.values)))
        value = program.values[vid]
        if not value.ndim or any(a.value == vid for a in out):
            continue
        action = Action(vid, int(rng.integers(value.ndim)), str(rng.choice(list(AXES))))
        try:
            state.check_action(action)
        except ShardingError:
            continue
        out.append(action)
        if len(out) == n:
            break
    return out


def _walk(name, seed, steps=6):
    """States after random decision groups, each checked against the plain propagation."""
    program = PROGRAMS[name]()
    rng = np.random.default_rng(seed)
    state = ShardingState.initial(program, AXES)
    states = [state]
    for k in range(steps):
        actions = _random_actions(state, rng, int(rng.integers(1, 4)))
        if not actions:
            break
        want_specs, want_prio = _reference_apply(state, actions, f"d{k}")
        if k % 2 == 0:
            estimate(state)  # an analysed ancestor: the next analyses start from it
        state = apply(state, actions, label=f"d{k}")
        assert dict(state.specs) == want_specs
        assert dict(state.priority) == want_prio
        states.append(state)
    return states


CASES = [(name, seed) for name in PROGRAMS for seed in range(3)]


@pytest.mark.parametrize("name,seed", CASES)
def test_propagation_matches_the_plain_algorithm(name, seed):
    assert len(_walk(name, seed)) > 2


@pytest.mark.parametrize("name,seed", CASES)
def test_memoised_solutions_match_solve_factors_for_any_priorities(name, seed):
    rng = np.random.default_rng(100 + seed)
    checked = order_free = 0
    for state in _walk(name, seed):
        specs, prio = state.specs, state.priority
        for op in state.program.all_ops:
            sol = solution(op, state.axes, state.mesh_key, specs, prio)
            fax, fprio = solve_factors(op, state, specs, prio)
            assert sol.fax == fax and sol.priorities(op.linked, prio) == fprio
            checked += 1
            key = (id(op.rule), tuple(map(specs.get, op.linked)), state.mesh_key)
            if SOLVED.get(key).__class__ is Solution:  # priorities left out of the key: shuffle them
                order_free += 1
                dims = [(v, d) for v in op.linked if specs.get(v) for d, ax in enumerate(specs[v]) if ax]
                shuffled = dict(prio)
                shuffled.update(zip(dims, rng.permutation(len(dims)).tolist()))
                assert solve_factors(op, state, specs, shuffled)[0] == fax
    assert checked and order_free


def _conflicting_state():
    prog = _program(lambda x, w: jnp.tanh(x @ w), sds(8, 16), sds(16, 32))
    s = apply(ShardingState.initial(prog, AXES), [Action(prog.inputs[0], 0, "data")])
    return prog, apply(s, [Action(prog.inputs[1], 0, "data"), Action(prog.inputs[1], 1, "model")])


def test_a_conflict_is_solved_per_priority():
    # x's batch dim and w's contracting dim both ask for 'data' at the dot: the earlier decision wins
    prog, s = _conflicting_state()
    dot = prog.ops[0]
    key = (id(dot.rule), tuple(map(s.specs.get, dot.linked)), s.mesh_key)
    assert SOLVED[key].__class__ is not Solution
    swapped = {k: (1 - p if p in (0, 1) else p) for k, p in s.priority.items()}
    early, late = (solve_factors(dot, s, s.specs, p)[0] for p in (s.priority, swapped))
    assert early != late
    assert solution(dot, s.axes, s.mesh_key, s.specs, s.priority).fax == early
    assert solution(dot, s.axes, s.mesh_key, s.specs, swapped).fax == late


@pytest.mark.parametrize("name,seed", CASES)
def test_incremental_cost_analysis_and_keys_match_fresh_ones(name, seed, monkeypatch):
    states = _walk(name, seed)
    fresh = [s.replace() for s in states]  # no memo, no origin: analysed from scratch
    module = importlib.import_module("automap.cost.estimate")
    got = [estimate(s) for s in states]
    for s, f in zip(states, fresh, strict=True):
        assert s.key() == frozenset(s.specs.items()) == f.key()
        assert op_analyses(s) == op_analyses(f)
    monkeypatch.setattr(module, "_op_totals", lambda program, analyses, axes, device, platform: module._op_totals_loop(
        program, (costs := module._OpCosts.of(program, platform)).static, analyses, module._split(costs, analyses, axes),
        axes, device))
    assert got == [estimate(f) for f in fresh]
    assert any(e.comm_time_s > 0 for e in got) or name == "square"
    assert all(math.isfinite(e.time_s) for e in got)
