"""The steps that cross plateaus one action at a time cannot: a sweep of every parameter over
one mesh axis, and the exact refinement (search.ilp.refine), whose pairwise model pays the
latency of collectives XLA combines once, however many parameters open them."""
import functools

import pytest

import automap
import search
from automap import zoo
from automap.cost import Topology
from automap.shardings import ShardingState
from search.greedy import replay, sweep
from search.objective import Objective
from search.space import GroupAction, TacticAction


@functools.cache
def _unrolled_gpt_space():
    """The benchmark's 2-layer unrolled GPT (d 256) on a 2x4 mesh, with the tactics as macros."""
    from automap.trace import feedback_pairs
    from tactics import PlanContext

    w = zoo.gpt_linen(zoo.GPTConfig(layers=2, scan=False, d_model=256, heads=8, vocab=2048, seq=128, batch=16))
    t = automap.trace(w.train_step, w.abstract())
    p = automap.lower(t.closed_jaxpr, t.in_paths, t.out_paths)
    state_in = tuple(sorted({p.inputs[i] for i in feedback_pairs(t).values()}))
    axes = {"data": 2, "model": 4}
    ctx = PlanContext(p, axes, tuple(v for v in p.inputs if v not in state_in), state_in)
    return search.SearchSpace(ShardingState.initial(p, axes), topology=Topology.preset("h100-8"),
                              data_inputs=ctx.data_inputs, context=ctx)


def _data_parallel_over_model():
    space = _unrolled_gpt_space()
    state, done = replay(space, (TacticAction("data_parallel", "model"),))
    assert done
    return space, state


def test_a_sweep_crosses_a_plateau_that_single_actions_cannot():
    space, state = _data_parallel_over_model()
    start = space.score(state)
    singles = [space.score(space.apply(state, a)) for a in space.legal(state)
               if isinstance(a, GroupAction) and a.axis == "model"]
    assert singles and min(s.time_s for s in singles) > start.time_s  # each one alone is slower
    moves, _, end = sweep(space, state, "model")
    assert len({a.group for a in moves}) == len(moves) == 7  # every parameter group, one action each
    assert end.time_s < 0.95 * start.time_s  # all of them together: more than 5% faster


def test_the_pairwise_model_pays_a_combine_groups_latency_once():
    from search.ilp import _Incumbent, options
    from search.pairwise_model import PairwiseModel, latencies

    space, state = _data_parallel_over_model()
    moves, _, end = sweep(space, state, "model")
    opts = options(space, state, two_axes=False, tie=False)
    assert all((a,) in opts[a.group] for a in moves)
    start = (TacticAction("data_parallel", "model"),)
    incumbent = _Incumbent(space, (state, space.score(state), start), Objective(tolerance=0.0))
    model = PairwiseModel(space, start, opts, None, incumbent.consider)
    predicted = model.value({a.group: (a,) for a in moves})
    assert predicted == pytest.approx(end.time_s, rel=1e-9)
    # the sweep opens combine groups that each parameter alone opens too: priced per parameter
    # and corrected per pair (the model without these columns), it would be far off
    opened = set(latencies(space, end)) - set(latencies(space, space.score(state)))
    assert opened and all(any(k in f for f in model.flips.values()) for k in opened)


def test_refining_the_root_equals_brute_force_over_one_action_per_group():
    from test_search import _mlp_space

    from search.ilp import brute_force, refine

    space = _mlp_space()
    best_time, _ = brute_force(_mlp_space())
    state, score, moves = refine(space, (space.root, space.score(space.root), ()))
    assert score.time_s == pytest.approx(best_time, rel=1e-12)
    assert replay(space, moves)[0].key() == state.key()  # the moves make the plan
    assert refine(space, (space.root, space.score(space.root), ()), max_work=1) is None  # too costly: skipped


def test_tokens_and_targets_tied_by_propagation_are_one_decision_for_the_pairwise_model():
    import itertools

    from search.ilp import _Incumbent, options
    from search.pairwise_model import PairwiseModel

    space = _unrolled_gpt_space()
    names = [space.group_name(g) for g in range(len(space.groups))]
    tokens, targets = names.index("batch/tokens"), names.index("batch/targets")
    raw = options(space, space.root, two_axes=False, tie=False)
    tied = options(space, space.root, two_axes=False)
    assert sorted([len(tied[tokens]), len(tied[targets])])[0] == 1  # one of them is left with () only
    joint = tied[tokens] if len(tied[tokens]) > 1 else tied[targets]

    def plans(*opts):
        return {replay(space, sum(choice, ()))[0].key() for choice in itertools.product(*opts)}

    assert plans(joint) == plans(raw[tokens], raw[targets])  # every joint choice, once per plan
    assert len(joint) == len(plans(joint)) < len(raw[tokens]) * len(raw[targets])

    # data parallel over 'model' (both inputs' batch dim) and the head's input dim over 'model':
    # tokens and targets priced apart count the head's interaction with the batch twice
    head = names.index("state/params/head/kernel")
    batch = {g: next(o for o in raw[g] if o and (o[0].dim, o[0].axis) == (0, "model")) for g in (tokens, targets)}
    assert replay(space, batch[tokens])[0].key() == replay(space, batch[targets])[0].key()
    sharded = next(o for o in raw[head] if o and (o[0].dim, o[0].axis) == (0, "model"))
    merged = tokens if len(tied[tokens]) > 1 else targets
    both = next(o for o in joint if replay(space, o)[0].key() == replay(space, batch[tokens])[0].key())
    consider = _Incumbent(space, (space.root, space.score(space.root), ()), Objective(tolerance=0.0)).consider

    def model(opts, keep):
        return PairwiseModel(space, (), [o if g in keep else [()] for g, o in enumerate(opts)], None, consider)

    def real(*moves):  # a plan applies its options in group order, as the model measured them
        return space.score(replay(space, sum(moves, ()))[0]).time_s

    assert head < min(tokens, targets)
    apart = model(raw, (tokens, targets, head)).value({**batch, head: sharded})
    assert abs(apart / real(sharded, batch[targets], batch[tokens]) - 1) > 0.2  # 42% here
    together = model(tied, (merged, head)).value({merged: both, head: sharded})
    # one decision: the pair is measured; what is left is a latency the pair no longer pays
    assert together == pytest.approx(real(sharded, both), rel=0.01)
