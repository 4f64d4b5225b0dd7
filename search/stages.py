"""The search as a chain of stages, in the style of optax: each stage maps ``(space, found,
objective)`` to a new ``found`` (the best plan so far and the plans met on the way), and
:func:`chain` composes them. :class:`search.MCTS` is such a chain (see ``MCTS.stages``):

- :class:`Compose`: the tactic compositions (a beam over the macro-actions, any tactic on any axis
  in any order, :mod:`search.compose`);
- :class:`Tree`: Monte Carlo tree search proper, seeded with them (:mod:`search.tree`);
- :class:`Polish`: one improving move at a time;
- :class:`Repair`: the same climb from the plans met faster than the best but over the memory
  budget (a binding budget only);
- :class:`Sweep`: every decision group over one mesh axis at once, axes taken greedily (the
  plateaus one move at a time cannot cross), from the best plan and the fastest compositions;
- :class:`Refine`: one more action per group, all decided together exactly (:func:`search.ilp.refine`);
- :class:`LeanestTie`: among the plans met within the tie tolerance, the leanest
  (:meth:`search.objective.Objective.choose`).

Every stage orders plans by the same :class:`~search.objective.Objective`; none of them
enumerates the orderings of the mesh axes.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Protocol

import numpy as np

from search.base import SearchResult, SearchStats, check_macros
from search.compose import BEAM_WIDTH, compositions, expert_ceiling, expert_plan
from search.greedy import best_preemption, best_step, sweep
from search.ilp import refine
from search.objective import Objective
from search.space import DEFAULT_MACROS, Plan, SearchSpace, TacticAction
from search.tree import Node, RolloutFn, SelectFn, grow, path_to, plans_of, random_rollout, run_episodes, uct_select


@dataclasses.dataclass(frozen=True)
class Found:
    """What flows along the chain: the best plan so far, the other plans met (later stages start
    from them or choose among them), the episodes run and the best value after each step."""

    best: Plan
    pool: tuple[Plan, ...] = ()
    episodes: int = 0
    curve: tuple[float, ...] = ()

    @staticmethod
    def start(space: SearchSpace) -> "Found":
        return Found(Plan(space.root, space.score(space.root), ()))

    def met(self, plans: list[Plan] | tuple[Plan, ...], objective: Objective) -> "Found":
        """With ``plans`` added to the pool, and the best of them if it beats the best so far."""
        top = objective.best(plans)
        best = top if top is not None and objective.better(top.score, self.best.score) else self.best
        return dataclasses.replace(self, best=best, pool=self.pool + tuple(plans))


class Stage(Protocol):
    name: str

    def __call__(self, space: SearchSpace, found: Found, objective: Objective) -> Found: ...


@dataclasses.dataclass(frozen=True)
class Chain:
    """Stages applied in order: itself a stage, so chains nest."""

    stages: tuple[Stage, ...]
    name: str = "chain"

    def __call__(self, space: SearchSpace, found: Found, objective: Objective,
                 on_stage: Callable[[str, Found], None] = lambda name, found: None) -> Found:
        for stage in self.stages:
            on_stage(stage.name, found)
            found = stage(space, found, objective)
        return found


def chain(*stages: Stage) -> Chain:
    """Compose stages; nested chains are flattened.

    >>> import search
    >>> [s.name for s in chain(search.stages.Polish(), chain(search.stages.Sweep(), search.stages.Refine())).stages]
    ['polish', 'sweep', 'refine']
    """
    flat: list[Stage] = []
    for s in stages:
        flat.extend(s.stages if isinstance(s, Chain) else (s,))
    return Chain(tuple(flat))


@dataclasses.dataclass(frozen=True)
class Compose:
    """Add the tactic compositions (:func:`search.compose.compositions`) to the pool, at most
    ``limit`` of them (the best first)."""

    width: int = BEAM_WIDTH
    limit: int | None = None
    name: str = "compose"

    def __call__(self, space: SearchSpace, found: Found, objective: Objective) -> Found:
        plans = compositions(space, self.width)[:self.limit] if space.macros else []
        return found.met(plans, objective)


@dataclasses.dataclass(frozen=True)
class Tree:
    """Monte Carlo tree search from the root, for ``episodes`` in all: first the compositions of
    the pool grown into the tree and backed up (each an episode), then UCT episodes with the
    injected ``select_fn`` and ``rollout_fn``. Deterministic for ``seed``."""

    episodes: int = 48
    seed: int = 0
    exploration: float = 0.5
    rollout_depth: int = 2
    select_fn: SelectFn = uct_select
    rollout_fn: RolloutFn = random_rollout
    time_budget_s: float | None = None
    on_episode: Callable[[Plan], None] = lambda best: None
    name: str = "tree"

    def __call__(self, space: SearchSpace, found: Found, objective: Objective) -> Found:
        rng = np.random.default_rng(self.seed)
        root = Node(space.root, (), space.legal(space.root))
        best, curve, seeded = found.best, list(found.curve), 0
        for plan in found.pool:
            if not all(isinstance(m, TacticAction) for m in plan.moves) or seeded >= self.episodes:
                continue
            leaf = grow(space, root, plan.moves)
            if leaf is None:
                continue
            seeded += 1
            backup_value = objective.value(space.score(leaf.state))
            for node in path_to(root, leaf.actions):
                node.visits, node.value = node.visits + 1, node.value + backup_value
            curve.append(best.score.reward)
            self.on_episode(best)

        def episode(plan: Plan) -> None:
            nonlocal best
            best = plan if objective.better(plan.score, best.score) else best
            curve.append(best.score.reward)
            self.on_episode(best)

        deadline = None if self.time_budget_s is None else time.perf_counter() + self.time_budget_s
        got = run_episodes(space, root, objective, episodes=self.episodes - seeded, rng=rng,
                           exploration=self.exploration, rollout_depth=self.rollout_depth, select_fn=self.select_fn,
                           rollout_fn=self.rollout_fn, deadline=deadline, on_episode=episode)
        found = dataclasses.replace(found, episodes=found.episodes + len(curve) - len(found.curve),
                                    curve=tuple(curve))
        return found.met([got] + plans_of(space, root), objective)


@dataclasses.dataclass(frozen=True)
class Polish:
    """Hill-climb from the best plan, one improving move at a time, at most ``steps`` and no step
    begun after ``budget`` new plans were evaluated (each step tries every legal move, more on more
    mesh axes: the budget bounds a polish on any number of axes); with
    ``preempt``, a step may also decide one group before the plan's moves (costly: replays)."""

    steps: int = 4
    preempt: bool = False
    budget: int = 64  # no step begins once this many plans were evaluated (a step evaluates every move)
    name: str = "polish"

    def __call__(self, space: SearchSpace, found: Found, objective: Objective) -> Found:
        done = space.memo.setdefault("polished", set())  # plans a polish ended on: nothing improves them
        plan, curve = found.best, list(found.curve)
        if (plan.state.key(), objective) in done:
            return found
        evaluations = space.evaluations
        for _ in range(self.steps):
            if space.evaluations - evaluations >= self.budget:
                break
            step = best_step(space, plan.state, plan.score, objective)
            if step is not None:
                plan = Plan(step[1], step[2], plan.moves + (step[0],))
            elif self.preempt and (moved := best_preemption(space, plan.moves, plan.score, objective)) is not None:
                plan = Plan(moved[1], moved[2], moved[0])
            else:
                done.add((plan.state.key(), objective))
                break
            curve.append(plan.score.reward)
        return dataclasses.replace(found, curve=tuple(curve)).met([plan], objective)


@dataclasses.dataclass(frozen=True)
class Repair:
    """Under a memory budget that binds (a plan met is faster than the best but over the budget):
    polish (hill-climb, as :class:`Polish`) from the best valued of those plans, where one more
    split often makes a fast plan fit that the tree left behind, its best already fitting, and
    that :class:`Polish`, climbing from that best, does not reach. An over-budget plan's value
    falls with its peak (:mod:`search.objective`), so the climb heads under the budget; at most
    ``starts`` climbs, every plan one ends on a candidate. Nothing runs where no plan met is over
    the budget."""

    starts: int = 2
    steps: int = 8
    budget: int = 128  # plans evaluated per climb
    name: str = "repair"

    def __call__(self, space: SearchSpace, found: Found, objective: Objective) -> Found:
        over = sorted(_budget_excluded(found), key=lambda p: objective.key(p.score))  # fast, and the least over
        starts = list({p.state.key(): p for p in over}.values())[:self.starts]
        climb = Polish(self.steps, budget=self.budget)
        return found.met([climb(space, Found(start), objective).best for start in starts], objective)


def _budget_excluded(found: Found) -> list[Plan]:
    """The plans met faster than the best that the memory budget excludes."""
    return [p for p in found.pool if not p.score.feasible and p.score.time_s < found.best.score.time_s]


@dataclasses.dataclass(frozen=True)
class Sweep:
    """Sweep (:func:`search.greedy.sweep`) the best plan and the fastest compositions of the pool,
    ``starts`` distinct plans in all, over the mesh axes greedily: every open axis of the plan
    (:meth:`SearchSpace.open_axes`: like axes in like places count once) is swept, the best result
    goes on to the axes not swept yet, and so on; at most ``budget`` sweeps in all, the best start
    first (at most ``A (A + 1) / 2`` sweeps per start on ``A`` axes, never one per ordering of the
    axes, and the same budget on any number of axes). Every plan on the way is a candidate."""

    starts: int = 4
    tactics: int = 2  # compositions of at most this many tactics (longer ones leave a sweep less to do)
    budget: int = 12  # what 4 starts take on 2 axes (3 sweeps each)
    name: str = "sweep"

    def __call__(self, space: SearchSpace, found: Found, objective: Objective) -> Found:
        seeds = sorted((p for p in found.pool if 0 < len(p.moves) <= self.tactics
                        and all(isinstance(m, TacticAction) for m in p.moves)),
                       key=lambda p: p.score.time_s)  # over the budget and the ceiling too: a sweep shards more
        starts = list({p.state.key(): p for p in [found.best] + seeds}.values())[:self.starts]
        met: list[Plan] = []
        left_budget = self.budget
        for end in starts:
            left = list(space.axes)
            while left and left_budget > 0:
                axes = _open(space, end, left)[:left_budget]
                left_budget -= len(axes)
                tries = [(axis, _swept(space, end, axis, objective)) for axis in axes]
                met += [p for _, p in tries]
                axis, end = min(tries, key=lambda t: objective.key(t[1].score))
                left.remove(axis)
        return found.met(met, objective)


def _open(space: SearchSpace, plan: Plan, axes: list[str]) -> list[str]:
    """``axes`` less those a like axis stands for (:meth:`SearchSpace.open_axes`)."""
    return [a for a in space.open_axes(plan.state) if a in axes] or axes


def _swept(space: SearchSpace, plan: Plan, axis: str, objective: Objective) -> Plan:
    moves, state, score = sweep(space, plan.state, axis, objective)
    return Plan(state, score, plan.moves + moves)


@dataclasses.dataclass(frozen=True)
class Refine:
    """The exact step around the best plan (:func:`search.ilp.refine`), when it costs at most
    ``max_work`` plans evaluated times ops (deterministic: no clock decides whether it runs)."""

    max_work: int = 250_000
    name: str = "refine"

    def __call__(self, space: SearchSpace, found: Found, objective: Objective) -> Found:
        got = refine(space, found.best, objective, self.max_work) if self.max_work else None
        return found if got is None else found.met([Plan(*got)], objective)


@dataclasses.dataclass(frozen=True)
class LeanestTie:
    """The answer among every plan met (:meth:`search.objective.Objective.choose`): the leanest
    within the tie tolerance of the best, with the fastest expert plan as the anchor when the
    objective holds to its ceiling."""

    name: str = "tie"

    def __call__(self, space: SearchSpace, found: Found, objective: Objective) -> Found:
        anchor = expert_plan(space) if objective.ceiling is not None else None
        return dataclasses.replace(found, best=objective.choose((found.best,) + found.pool, anchor))


@dataclasses.dataclass(frozen=True)
class ChainSearch:
    """A searcher running any chain of ``stages`` from the root, under the objective of
    ``tolerance`` and (with ``ceiling``) the expert ceiling: e.g. the default chain less one stage,
    for an ablation (``benchmarks/ablation.py``); :class:`search.MCTS` runs its own chain.

    >>> import search
    >>> full = search.MCTS().stages()
    >>> s = ChainSearch(chain(*(stage for stage in full.stages if stage.name != "sweep")), name="no sweep")
    >>> [stage.name for stage in s.stages.stages]
    ['compose', 'tree', 'polish', 'repair', 'polish', 'refine', 'tie']
    """

    stages: Chain
    tolerance: float = 0.01
    ceiling: bool = True  # hold to the fastest composition's bytes and memory (search.compose.expert_ceiling)
    name: str = "chain"
    macros: tuple[str, ...] = DEFAULT_MACROS  # the tactic macros its space offers (search.space.macro_names)

    def __post_init__(self) -> None:
        check_macros(self)

    def search(self, space: SearchSpace) -> SearchResult:
        t0 = time.perf_counter()
        objective = Objective(self.tolerance, expert_ceiling(space) if self.ceiling else None)
        found = self.stages(space, Found.start(space), objective)
        stats = SearchStats(found.episodes, space.evaluations, time.perf_counter() - t0, space.eval_time_s,
                            found.curve)
        return SearchResult(found.best.state, found.best.score, found.best.moves, stats, self.name)
