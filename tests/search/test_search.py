"""Search: folding is depth-independent, MCTS is deterministic for a seed (golden sequences),
greedy and MCTS improve on the root, the plan runs and matches the unsharded step, and an
infeasible memory budget says how close the search came and what dominates."""
import functools

import jax
import numpy as np
import pytest

import automap
import search
import search.progress
from automap import zoo
from automap.cost import Topology
from automap.ir.fold import fold
from automap.shardings import ShardingState
from search.planning import MemoryBudgetError

CFG = dict(d_model=32, heads=4, vocab=64, seq=16, batch=8)


def _program(w):
    t = automap.trace(w.train_step, w.abstract())
    return automap.lower(t.closed_jaxpr, t.in_paths, t.out_paths)


def test_folding_is_depth_independent():
    counts = []
    for layers in (2, 6):
        p = _program(zoo.gpt_linen(zoo.GPTConfig(layers=layers, **CFG)))
        groups = fold(p, p.inputs)
        counts.append(len(groups))
        qkv = [g for g in groups if p.values[g[0]].name.endswith("params/blocks_0/attn/qkv/kernel")]
        assert len(qkv) == 1 and len(qkv[0]) == layers  # one decision for every layer's qkv kernel
    assert counts[0] == counts[1]


def _space(layers=2, scan=True):
    w = zoo.gpt_linen(zoo.GPTConfig(layers=layers, scan=scan, **CFG))
    p = _program(w)
    data = [v for v, path in zip(p.inputs, p.input_paths) if path.startswith("batch/")]
    root = ShardingState.initial(p, {"data": 2, "model": 4})
    return search.SearchSpace(root, topology=Topology.preset("cpu-sim"), data_inputs=data)


def test_golden_default_chain():
    space = _mlp_space(300_000)  # the tree, polish and refine stages have goldens on the GPT (test_stages.py)
    result = search.MCTS(episodes=8, seed=0).search(space)
    assert result.describe(space) == ["params/w1 dim 1 on 'model'"]
    assert result.score.feasible and result.score.reward > 1.0 and result.stats.episodes == 8
    # one point per episode, then per polishing step; the best only ever improves
    assert len(result.stats.curve) >= 8 and result.stats.curve == tuple(sorted(result.stats.curve))
    assert search.greedy.replay(space, result.actions)[0].key() == result.state.key()  # the moves make the plan


def test_progress_bar_names_the_stages_after_the_tree_and_stays_quiet_off_a_terminal(capsys, monkeypatch):
    cheap = dict(episodes=4, seed=0, refine_work=0)
    search.MCTS(**cheap).search(_mlp_space())
    assert capsys.readouterr().err == ""  # pytest's stderr is no terminal: no bar by default
    monkeypatch.setattr(search.progress, "BAR_DELAY_S", 0.0)
    search.MCTS(**cheap, progress=True).search(_mlp_space())
    err = capsys.readouterr().err
    steps = ("polish", "repair", "sweep", "polish", "tie")
    for i, step in enumerate(steps):  # each stage is shown as it begins
        assert f"automap search: {step}:" in err and f"| {4 + i}/{4 + len(steps)} [" in err
    assert "best=" in err


def test_greedy_reaches_a_local_optimum():
    space = _space()
    result = search.Greedy().search(space)
    assert result.score.reward > 1.0
    for action in space.legal(result.state):  # no single action improves it
        assert space.score(space.apply(result.state, action)).reward <= result.score.reward


def test_searched_plan_runs_and_matches_unsharded():
    w = zoo.gpt_linen(zoo.GPTConfig(layers=2, scan=True, **CFG))
    state, batch = w.init(0)
    mesh = automap.make_mesh({"data": 2, "model": 4})
    cheap = search.MCTS(episodes=2, seed=0, seed_tactics=False, polish_steps=0, sweeps=0, refine_work=0)  # tree only
    step = automap.automap(w.train_step, mesh=mesh, tactics=[], search=cheap)
    plan = step.plan(state, batch)
    assert any(n.startswith("search mcts") for n in plan.notes)
    _, loss = step(state, batch)
    np.testing.assert_allclose(loss, jax.jit(w.train_step)(state, batch)[1], rtol=1e-5)


def test_infeasible_budget_names_the_smallest_peak_and_the_largest_values():
    w = zoo.gpt_linen(zoo.GPTConfig(layers=2, scan=True, **CFG))
    mesh = automap.make_mesh({"data": 2, "model": 4})
    cheap = search.MCTS(episodes=4, seed=0, seed_tactics=False, polish_steps=0, sweeps=0, refine_work=0)
    step = automap.automap(w.train_step, mesh=mesh, tactics=[], search=cheap, memory_budget="10KiB")
    with pytest.raises(MemoryBudgetError) as err:
        step.plan(*w.abstract())
    msg = str(err.value)
    assert "10.0 KiB" in msg and "smallest per-device peak explored was" in msg
    assert "state/" in msg and "Raise memory_budget" in msg


@functools.cache
def _gpt_context(axes_items):
    from automap.trace import feedback_pairs
    from tactics import PlanContext

    w = zoo.gpt_linen(zoo.GPTConfig(layers=2, scan=True, d_model=128, heads=4, vocab=512, seq=64, batch=16))
    t = automap.trace(w.train_step, w.abstract())
    p = automap.lower(t.closed_jaxpr, t.in_paths, t.out_paths)
    state_in = tuple(sorted({p.inputs[i] for i in feedback_pairs(t).values()}))
    axes = dict(axes_items)
    ctx = PlanContext(p, axes, tuple(v for v in p.inputs if v not in state_in), state_in)
    return ctx, ShardingState.initial(p, axes)


def _gpt_space(budget=None):
    """The 2-layer scanned GPT on a 2x4 mesh, with the tactics as macro-actions."""
    ctx, root = _gpt_context((("data", 2), ("model", 4)))
    return search.SearchSpace(root, topology=Topology.preset("h100-8"), memory_budget=budget,
                              data_inputs=ctx.data_inputs, context=ctx), ctx, root


def test_tactic_macro_actions_recover_megatron_data_parallel():
    import tactics
    from tactics import run_schedule

    space, ctx, root = _gpt_space()
    expert = space.score(run_schedule([tactics.data_parallel("data"), tactics.megatron("model")], ctx, root).state)
    found = search.stages.Compose()(space, search.Found.start(space), search.Objective(tolerance=0.0))
    assert found.best.score.time_s <= expert.time_s * (1 + 1e-9)
    assert found.best.moves  # and it says how it got there
    # the beam holds every composition of the tactics one per axis (in mesh order), and more
    best_seed = min(space.score(search.greedy.replay(space, s)[0]).time_s
                    for s in search.compose.tactic_compositions(space, limit=100))
    assert found.best.score.time_s <= best_seed * (1 + 1e-9)


def _budget():
    """80% of data parallelism's estimated peak: data parallelism does not fit."""
    import tactics
    from tactics import run_schedule

    space, ctx, root = _gpt_space()
    return int(0.8 * space.score(run_schedule([tactics.batch_over_all_axes()], ctx, root).state).peak_bytes)


CEILING_SOURCE = "data_parallel('model') + megatron('data')"  # Megatron over 'data' after data parallel over 'model'


def test_the_answer_is_no_heavier_than_the_fastest_expert_plan():
    budget = _budget()
    space, _, _ = _gpt_space(budget)
    ceiling = search.expert_ceiling(space)
    assert ceiling.source == CEILING_SOURCE
    cheap = dict(episodes=8, seed=0, refine_work=0)
    held = search.MCTS(**cheap).search(space)
    assert ceiling.admits(held.score)  # within the ceiling's tolerance (0.1%) of its bytes and memory
    assert held.notes and ceiling.source in held.notes[0]
    free = search.MCTS(**cheap, expert_ceiling=False).search(space)
    assert free.score.time_s <= held.score.time_s and not free.notes  # free: no slower, and says no ceiling


def test_ilp_under_a_ceiling_equals_brute_force_under_it():
    from search.ilp import brute_force

    free = search.ILP().search(_mlp_space())
    ceiling = search.Ceiling(wire_bytes=free.score.estimate.wire_bytes / 2, peak_bytes=10**9)
    best_time, _ = brute_force(_mlp_space(), ceiling)
    held = search.ILP(ceiling=ceiling).search(_mlp_space())
    assert ceiling.admits(held.score) and held.score.time_s == pytest.approx(best_time, rel=1e-12)
    assert held.score.time_s > free.score.time_s  # the ceiling cut the unconstrained optimum off


def _mlp_space(budget=None):
    import jax.numpy as jnp

    def step(params, x):
        def loss(p):
            return jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]).sum()
        value, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value

    args = ({"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)},
            jax.ShapeDtypeStruct((32, 64), jnp.float32))
    t = automap.trace(step, args)
    p = automap.lower(t.closed_jaxpr, t.in_paths, t.out_paths)
    root = ShardingState.initial(p, {"data": 2, "model": 4})
    groups = [(p.inputs[0],), (p.inputs[1],)]  # the two weights; the batch stays whole
    return search.SearchSpace(root, topology=Topology.preset("cpu-sim"), groups=groups, memory_budget=budget)


@pytest.mark.parametrize("budget", [None, 300_000])
def test_ilp_equals_brute_force(budget):
    from search.ilp import brute_force

    best_time, _ = brute_force(_mlp_space(budget))
    result = search.ILP().search(_mlp_space(budget))
    assert result.score.feasible and result.notes == (search.ilp.OPTIMAL,)
    assert result.score.time_s == pytest.approx(best_time, rel=1e-12)
    mcts = search.MCTS(episodes=24, seed=0).search(_mlp_space(budget))
    assert mcts.score.time_s <= best_time * 1.02  # the search's gap, measured


def _tactics_space():
    """A two-axis space with the tactic macros (a context): its starts are the root and the compositions."""
    from tactics import PlanContext

    def step(w, x):
        return w - jax.numpy.tanh(x @ w).T @ x

    prog = automap.lower(jax.make_jaxpr(step)(np.ones((8, 8)), np.ones((16, 8))), ["w", "x"], ["w"])
    axes = {"data": 2, "model": 2}
    return search.SearchSpace(ShardingState.initial(prog, axes), topology=Topology.preset("h100-8"),
                              context=PlanContext(prog, axes, (prog.inputs[1],), (prog.inputs[0],)))


def test_with_tactics_the_ilp_also_chooses_a_composition_to_start_from():
    from search.ilp import brute_force, combinations, starts

    space = _tactics_space()
    assert starts(space)[0] == () and len(starts(space)) == 1 + len(search.compositions(space))
    assert len(combinations(space)) == len(starts(space))  # every composition is a distinct plan
    best_time, _ = brute_force(space)
    result = search.ILP().search(space)
    assert result.notes == (search.ilp.OPTIMAL,)
    assert result.score.time_s == pytest.approx(best_time, rel=1e-12)


def test_an_ilp_stopped_by_its_limits_says_so():
    result = search.ILP(max_rounds=1, time_limit_s=1e-9).search(_mlp_space())
    assert result.notes[0].startswith("not proved optimal")


def test_ilp_refuses_spaces_too_large():
    """Sized with one axis per option first (no plan made for it, never more than the full
    count): a space that is too large already is refused before its two-axis options are made."""
    from search.ilp import MERGE_FIRST, _pairs_needed, combinations

    space = _mlp_space()
    one, two = (sum(1 + _pairs_needed(opts) for _, opts in combinations(space, tie=False, two_axes=both))
                for both in (False, True))
    assert one < two
    with pytest.raises(search.TooLarge, match=f"would need at least {one} cost evaluations"):
        search.ILP(max_evaluations=one // MERGE_FIRST - 1).search(_mlp_space())
    with pytest.raises(search.TooLarge, match=f"would need {two} cost evaluations"):  # the full count
        search.ILP(max_evaluations=one // MERGE_FIRST + 1).search(_mlp_space())


def test_ilp_refuses_a_space_its_root_shows_too_large_before_building_the_compositions():
    """The root (the first start) on one axis per option bounds the size from below: too large
    there, the space is refused with that count before any composition is built."""
    from search.ilp import MERGE_FIRST, _pairs_needed, options

    space = _tactics_space()
    first = 1 + _pairs_needed(options(space, space.root, two_axes=False, tie=False))
    assert first > 2 * MERGE_FIRST
    with pytest.raises(search.TooLarge, match=f"would need at least {first} cost evaluations"):
        search.ILP(max_evaluations=first // MERGE_FIRST - 1).search(space)
    assert "compositions" not in space.memo
    assert len(search.compositions(space)) > 0  # there were starts to build


def _mlp_workload():
    return zoo.mlp(zoo.MLPConfig(d_in=16, hidden=(64, 64), d_out=8, batch=16))


def test_the_default_plan_is_the_search_over_every_mesh_axis():
    w = _mlp_workload()
    mesh = automap.make_mesh({"data": 2, "model": 4})
    from automap.planner import default_search

    assert default_search(None, {"data": 2, "model": 4}) == search.MCTS()  # the default chain, every axis
    default = automap.automap(w.train_step, mesh=mesh).plan(*w.abstract())
    (note,) = [n for n in default.notes if n.startswith("search mcts")]
    assert "budget 4.0 GiB" in note  # the default budget: the topology's device memory (cpu-sim)
    batch = automap.automap(w.train_step, mesh=mesh, search=None).plan(*w.abstract())
    assert not any(n.startswith("search") for n in batch.notes)
    assert default.estimate.time_s <= batch.estimate.time_s


def test_with_tactics_the_search_fills_only_unused_axes():
    import tactics

    w = _mlp_workload()
    mesh = automap.make_mesh({"data": 2, "model": 4})
    full = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.data_parallel("data"), tactics.megatron("model")])
    assert not any(n.startswith("search") for n in full.plan(*w.abstract()).notes)
    part = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.data_parallel("data")]).plan(*w.abstract())
    assert any(n.startswith("search mcts") for n in part.notes)
    x = part.program.inputs[part.program.input_paths.index("batch/x")]
    assert part.state.spec(x)[0][0] == "data"  # the tactic's decision stands


def test_search_must_be_a_searcher():
    with pytest.raises(TypeError, match="search must be a searcher"):
        automap.automap(lambda x: x, mesh=automap.make_mesh({"data": 2}), search="mcts")


def test_fsdp_over_the_whole_mesh_is_a_final_candidate_whatever_its_estimate(monkeypatch):
    """Under a budget no expert ceiling holds to, FSDP over the whole mesh is still one of the
    plans XLA measures last, even estimated over the budget: a GNN's ZeRO-3 over (data, model)
    was estimated 138,888 B (its pinned layout) against a 112,665 B budget, and XLA measured
    110,584 B, the only plan within it."""
    from types import SimpleNamespace

    import search.mcts as mcts
    from search.space import Plan

    over = SimpleNamespace(feasible=False)
    joint = Plan(SimpleNamespace(key=lambda: "joint"), over, ())
    monkeypatch.setattr(mcts, "whole_mesh_fsdp", lambda space: joint)
    found = SimpleNamespace(best=SimpleNamespace(state=SimpleNamespace(key=lambda: "answer")), pool=())
    objective = SimpleNamespace(best=lambda plans: None, ceiling=None)
    got = mcts._alternatives(SimpleNamespace(describe=str, macros=()), found, None, objective)
    assert [(label, plan.state) for label, plan in got] == [("expert ()", joint.state)]


def test_where_no_composition_fits_by_estimate_the_leanest_are_final_candidates(monkeypatch):
    """No composition fits the budget by estimate (no ceiling): besides FSDP over the whole mesh,
    the two compositions leanest by estimate are measured by XLA (held-out eqx_conv_gru: before,
    only the answer and ZeRO-3 over the mesh were)."""
    from types import SimpleNamespace

    import search.mcts as mcts
    from search.space import Plan

    def plan(key, peak):
        return Plan(SimpleNamespace(key=lambda: key), SimpleNamespace(feasible=False, peak_bytes=peak), (key,))

    joint = plan("joint", 900)
    monkeypatch.setattr(mcts, "whole_mesh_fsdp", lambda space: joint)
    monkeypatch.setattr(mcts, "compositions", lambda space: [plan("dp", 400), plan("answer", 100), joint,
                                                             plan("tp", 300), plan("fsdp", 200)])
    found = SimpleNamespace(best=SimpleNamespace(state=SimpleNamespace(key=lambda: "answer")), pool=())
    objective = SimpleNamespace(best=lambda plans: None, ceiling=None)
    got = mcts._alternatives(SimpleNamespace(describe=str, macros=("fsdp",)), found, None, objective)
    assert [label for label, _ in got] == ["expert (joint)", "leanest expert (fsdp)", "leanest expert (tp)"]


def test_a_budget_no_plan_fits_by_estimate_is_met_by_a_final_candidate_xla_measures_within_it(monkeypatch):
    """The estimate errs both ways: where every explored plan is over the budget by estimate (here
    the estimate's temporaries are inflated 4x, as for a model whose buffers XLA:CPU fuses away),
    XLA measures the search's final candidates against the budget (then searches again under the
    budget scaled by its measure over the estimate), and a plan within it by XLA's measure is the
    plan; before, the search raised MemoryBudgetError."""
    import dataclasses as dc

    import search.space
    from automap.measure import measure

    real = search.space.estimate

    def inflated(state, topology=None, **kw):
        est = real(state, topology, **kw)
        return dc.replace(est, memory=dc.replace(est.memory, temp=4 * est.memory.temp + 64 * 1024))

    w = zoo.gpt_linen(zoo.GPTConfig(layers=1, d_model=32, heads=4, vocab=64, seq=8, batch=8))
    mesh = automap.make_mesh({"data": 2, "model": 4})
    fsdp = automap.automap(w.train_step, mesh=mesh, tactics=[tactics_fsdp_whole_mesh()], search=None)
    budget = measure(fsdp.lower(*w.abstract()).compile()).memory_per_device + 1024
    monkeypatch.setattr(search.space, "estimate", inflated)
    cheap = search.MCTS(episodes=4, seed=0, polish_steps=0, sweeps=0, refine_work=0)
    step = automap.automap(w.train_step, mesh=mesh, tactics=[], search=cheap, memory_budget=budget)
    plan = step.plan(*w.abstract())
    assert any("XLA measures the plan within the budget" in n for n in plan.notes)
    assert measure(step.lower(*w.abstract()).compile()).memory_per_device <= budget
    state, batch = w.init(0)
    np.testing.assert_allclose(step(state, batch)[1], jax.jit(w.train_step)(state, batch)[1], rtol=1e-5)


def test_a_budget_nothing_fits_by_estimate_nor_by_measure_raises_naming_what_xla_measured():
    """Where no plan fits the budget by estimate and none of the final candidates XLA measures (nor
    those of the search under the budget scaled by its measure) fits either, the search's
    MemoryBudgetError names the smallest XLA measured beside its estimate; before, only the
    estimate's smallest explored peak (held-out attention_sdpa: 250.7 KiB by estimate)."""
    import jax.numpy as jnp

    def train_step(w, x):
        loss, g = jax.value_and_grad(lambda w: jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]).sum())(w)
        return [p - 0.1 * q for p, q in zip(w, g)], loss

    mesh = automap.make_mesh({"data": 2, "model": 4})
    cheap = search.MCTS(episodes=4, seed=0, polish_steps=0, sweeps=0, refine_work=0)
    step = automap.automap(train_step, mesh=mesh, search=cheap, memory_budget=4096)
    with pytest.raises(MemoryBudgetError, match=r"XLA measured the search's final candidates .*: the smallest is "
                                                r"[\d.]+ KiB per device = arguments [\d.]+ KiB \+ outputs [\d.]+ KiB "
                                                r"\(the state in and out\) \+ temporaries [\d.]+ KiB \([\d.]+ KiB by estimate\)"):
        step.plan([jnp.ones((64, 64)), jnp.ones((64, 64))], jnp.ones((32, 64)))


def tactics_fsdp_whole_mesh():
    import tactics

    return tactics.fsdp(("data", "model"))
