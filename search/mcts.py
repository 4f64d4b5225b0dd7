"""The default search: a chain of stages (:mod:`search.stages`) around Monte Carlo tree search,
all ordering plans by one :class:`~search.objective.Objective`."""
from __future__ import annotations

import dataclasses
import time

from search.base import SearchResult, SearchStats, check_fields, check_macros
from search.compose import ceiling_of, compositions, expert_ceiling, expert_plan, tactic_compositions, undominated, whole_mesh_fsdp
from search.objective import Objective
from search.progress import Progress
from search.space import DEFAULT_MACROS, Plan, Score, SearchSpace
from search.stages import Chain, Compose, Found, LeanestTie, Polish, Refine, Repair, Sweep, Tree, chain
from search.tree import RolloutFn, SelectFn, random_rollout, uct_select

__all__ = ["MCTS", "expert_ceiling", "tactic_compositions"]


@dataclasses.dataclass(frozen=True)
class MCTS:
    """UCT search and the stages around it; deterministic for a seed.

    The chain (:meth:`stages`): the tactic compositions (``seed_tactics``: a beam over the tactic
    macros on any mesh axis in any order, :mod:`search.compose`), tree search seeded with them
    (``episodes`` in all), polish (``polish_steps``; with it, the repair of plans met faster
    than the best but over the memory budget), sweeps over the mesh axes (``sweeps``
    starting plans), polish again, the exact refinement (``refine_work``) and the tie-break.

    The fastest composition that fits sets a ceiling (``expert_ceiling``, see ``search/ceiling.py``):
    the answer sends no more bytes and holds no more memory than that expert plan, and replaces it
    only when faster, or, within ``tie_tolerance`` of it, clearly leaner. The result's ``notes``
    name the plan. ``macros``: the tactics it composes and offers as moves, by name (default all of
    :func:`search.space.macro_names`); with none, it decides dim by dim alone:

    >>> import automap, search, jax.numpy as jnp
    >>> step = automap.partition(lambda w, x: jnp.tanh(x @ w).sum(), mesh=automap.make_mesh({"data": 2}),
    ...                          search=search.MCTS(episodes=4, macros=()), arbiter=None)
    >>> [n for n in step.plan(jnp.ones((256, 256)), jnp.ones((512, 256))).notes if n.startswith("search: ")]
    ["search: x dim 0 on 'data'"]
    >>> search.MCTS(episodes=8, seed=0).episodes
    8
    >>> [s.name for s in search.MCTS().stages().stages]
    ['compose', 'tree', 'polish', 'repair', 'sweep', 'polish', 'refine', 'tie']
    """

    episodes: int = 48
    seed: int = 0
    time_budget_s: float | None = None
    exploration: float = 0.5
    rollout_depth: int = 2
    select_fn: SelectFn = uct_select
    rollout_fn: RolloutFn = random_rollout
    polish_steps: int = 4  # greedy one-move improvements of the best plan after the episodes
    refine_work: int = 250_000  # the exact last step (search.ilp.refine) runs within this many op-evaluations
    sweeps: int = 4  # plans swept over the mesh axes after the episodes: the best, the fastest compositions
    seed_tactics: bool = True  # the first episodes try the compositions of tactic macros
    tie_tolerance: float = 0.01  # plans this close to the fastest count as ties: the leanest wins
    expert_ceiling: bool = True  # never send more bytes or hold more memory than the fastest composition
    preempt: bool = False  # polishing may also decide one group before the plan's actions (costly: replays)
    progress: bool | None = None  # None: a tqdm bar on a terminal once the search has run progress.BAR_DELAY_S
    name: str = "mcts"
    macros: tuple[str, ...] = DEFAULT_MACROS  # the tactic macros its space offers (search.space.macro_names)

    def __post_init__(self) -> None:
        check_fields(self, {"episodes": 1, "seed": 0, "time_budget_s": 0.0, "exploration": 0.0, "rollout_depth": 0,
                            "polish_steps": 0, "refine_work": 0, "sweeps": 0, "tie_tolerance": 0.0},
                     optional=("time_budget_s",), flags=("seed_tactics", "expert_ceiling", "preempt"))
        check_macros(self)
        for field in ("select_fn", "rollout_fn"):
            if not callable(getattr(self, field)):
                raise TypeError(f"MCTS({field}={getattr(self, field)!r}): {field} must be a function")

    def stages(self, on_episode=lambda best: None) -> Chain:
        """The chain this search runs (``on_episode`` is called with the best plan after each episode)."""
        polish = Polish(self.polish_steps, self.preempt)
        return chain(*(
            ([Compose(limit=self.episodes // 2)] if self.seed_tactics else [])
            + [Tree(self.episodes, self.seed, self.exploration, self.rollout_depth, self.select_fn, self.rollout_fn,
                    self.time_budget_s, on_episode), polish]
            + ([Repair()] if self.polish_steps else [])
            + ([Sweep(self.sweeps), polish] if self.sweeps else [])
            + ([Refine(self.refine_work)] if self.refine_work else [])
            + [LeanestTie()]
        ))

    def objective(self, space: SearchSpace) -> Objective:
        """The objective of this search on ``space``: its tie tolerance and the expert ceiling."""
        held = self.expert_ceiling and self.seed_tactics
        return Objective(self.tie_tolerance, expert_ceiling(space) if held else None)

    def search(self, space: SearchSpace) -> SearchResult:
        t0 = time.perf_counter()
        objective = self.objective(space)
        bar = Progress(self.episodes, self.progress)
        stages = self.stages(lambda best: bar.episode(best.score.reward))
        after_tree = [s.name for s in stages.stages[[s.name for s in stages.stages].index("tree") + 1:]]
        bar.steps(after_tree)

        def on_stage(name: str, found: Found) -> None:
            if name in after_tree:
                bar.step(name, found.episodes)

        found = stages(space, Found.start(space), objective, on_stage)
        bar.close()
        best = found.best
        stats = SearchStats(found.episodes, space.evaluations, time.perf_counter() - t0, space.eval_time_s,
                            found.curve)
        ceiling = objective.ceiling
        notes = () if ceiling is None else (
            f"held to the bytes sent ({ceiling.wire_bytes / 2**20:.2f} MiB) and memory "
            f"({ceiling.peak_bytes / 2**20:.1f} MiB) per device of the fastest expert plan: {ceiling.source}",)
        anchor = expert_plan(space) if ceiling is not None else None
        alternatives = _alternatives(space, found, anchor, objective)
        best, alternatives, repriced = as_emitted(space, objective, best, alternatives, anchor)
        return SearchResult(best.state, best.score, best.moves, stats, self.name, notes + repriced,
                            tuple((label, p.state, p.score) for label, p in alternatives))


def as_emitted(space: SearchSpace, objective: Objective, answer: Plan, alternatives: list[tuple[str, Plan]],
               anchor: Plan | None) -> tuple[Plan, list[tuple[str, Plan]], tuple[str, ...]]:
    """The answer and the final candidates priced as the programs they compile to
    (:meth:`~search.space.SearchSpace.emitted_score`): a plan that decided only its inputs runs in
    the layout XLA gives it, which the search, pricing automap's own propagation, did not see (a
    GShard MoE, 8 experts, batch 8, mesh 2x4: the answer 0.385 ms as searched, 0.774 ms as
    compiled, 10 all-to-alls XLA compiled). The answer is chosen again among them by the
    objective, its ceiling re-priced from the expert plan's program; returns the answer, the
    others (the answer as searched among them where it was replaced) and a note where a price moved."""
    priced = [("answer", answer)] + list(alternatives)
    repriced = [(label, Plan(p.state, space.emitted_score(p.state), p.moves)) for label, p in priced]
    moved = [(label, p, q) for (label, p), (_, q) in zip(priced, repriced) if _priced_apart(p.score, q.score)]
    if not moved:
        return answer, alternatives, ()
    again = None  # the expert plan re-priced: the ceiling and the anchor of a tie, as in the search's last stage
    if objective.ceiling is not None and anchor is not None:
        key = anchor.state.key()
        again = next((p for _, p in repriced if p.state.key() == key), None)
        if again is None:
            again = Plan(anchor.state, space.emitted_score(anchor.state), anchor.moves)
            repriced.append(("expert ceiling", again))
        objective = dataclasses.replace(objective, ceiling=ceiling_of(space, again))
    kept = objective.choose([p for _, p in repriced if p is not again], again)
    others = [("searched answer" if label == "answer" else label, p) for label, p in repriced if p is not kept]
    label = next(label for label, p in repriced if p is kept)
    prices = "; ".join(f"{label} {p.score.time_s * 1e3:.3f} -> {q.score.time_s * 1e3:.3f} ms" for label, p, q in moved)
    return kept, others, (f"priced as compiled (XLA lays out a plan that pins nothing): {prices}; kept the {label}",)


FRONT_CANDIDATES = 3  # expert compositions of the (bytes, memory) front XLA also measures, fastest first
LEAN_CANDIDATES = 2  # where no composition fits by estimate: the leanest by estimate, XLA measures them too


def _alternatives(space: SearchSpace, found: Found, anchor: Plan | None,
                  objective: Objective) -> list[tuple[str, Plan]]:
    """The final candidates besides the answer: the expert ceiling plan, the next best fitting
    plan met (by the objective), the fastest compositions no other composition dominates by
    estimate (:func:`search.compose.undominated`; at most :data:`FRONT_CANDIDATES`) and FSDP over
    the whole mesh (:func:`search.compose.whole_mesh_fsdp`, whatever its estimate: the plan an
    expert writes first for a model whose state outweighs its activations): the plans an expert
    would weigh, for XLA to measure (:func:`automap.arbiter.final_choice`). Where no composition
    fits the budget by estimate (no ceiling), the :data:`LEAN_CANDIDATES` compositions leanest by
    estimate too: the estimate errs both ways, and XLA's measure may find one of them within it."""
    out, seen = [], {found.best.state.key()}
    if anchor is not None and anchor.score.feasible and anchor.state.key() not in seen:
        source = objective.ceiling.source if objective.ceiling else "fastest composition"
        out.append((f"expert ceiling ({source})", anchor))
        seen.add(anchor.state.key())
    rest = objective.best(p for p in found.pool if p.score.feasible and p.state.key() not in seen)
    if rest is not None:
        out.append(("next best", rest))
        seen.add(rest.state.key())
    front = [] if anchor is None else sorted(
        undominated([p for p in compositions(space) if p.score.feasible]), key=lambda p: p.score.time_s)
    joint = whole_mesh_fsdp(space)  # with no expert ceiling too: under a tight budget, the smallest plan an expert has
    lean = [] if anchor is not None or not space.macros else sorted(compositions(space), key=lambda p: p.score.peak_bytes)
    for p in [p for p in front if p.state.key() not in seen][:FRONT_CANDIDATES] + [joint] * (joint is not None):
        if (p.score.feasible or p is joint) and p.state.key() not in seen:
            out.append((f"expert ({' + '.join(space.describe(a) for a in p.moves)})", p))
            seen.add(p.state.key())
    for p in [p for p in lean if p.state.key() not in seen][:LEAN_CANDIDATES]:
        out.append((f"leanest expert ({' + '.join(space.describe(a) for a in p.moves)})", p))
        seen.add(p.state.key())
    return out


def _priced_apart(a: Score, b: Score) -> bool:
    """Whether two scores of one plan differ in time, bytes sent or memory."""
    return (a.time_s, a.estimate.wire_bytes, a.peak_bytes) != (b.time_s, b.estimate.wire_bytes, b.peak_bytes)
