"""Monte Carlo tree search over sharding actions (UCT), in the style of mctx: the phases are
separate functions (select, expand, simulate, backup) and the strategies are injected.

A node holds a sharding state; its children are the states after one more group action. The
value of an episode is the best reward met on its path (a plan may stop at any node), so a
node's mean value estimates how good the plans below it are. Scores are cached per state (a
transposition table), so states reached along different action orders are evaluated once.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable

import numpy as np

from automap.shardings import ShardingState
from search.base import SearchResult, SearchStats, better, check_fields
from search.ceiling import Ceiling, backed_up, ranked
from search.greedy import best_preemption, best_step, sweep
from search.progress import Progress
from search.space import Move, Score, SearchSpace, TacticAction


@dataclasses.dataclass(eq=False)
class Node:
    state: ShardingState
    actions: tuple[Move, ...]
    untried: list[Move]
    children: dict[Move, "Node"] = dataclasses.field(default_factory=dict)
    visits: int = 0
    value: float = 0.0

    @property
    def mean(self) -> float:
        return self.value / self.visits if self.visits else 0.0


SelectFn = Callable[[Node, float], "Node"]
RolloutFn = Callable[[SearchSpace, ShardingState, np.random.Generator, int], tuple[ShardingState, Score]]


def uct_select(node: Node, exploration: float) -> Node:
    """The child maximising mean value + exploration * sqrt(ln N / n) (ties: first in order)."""
    log_n = math.log(max(node.visits, 1))
    return max(
        node.children.values(),
        key=lambda c: c.mean + exploration * math.sqrt(log_n / max(c.visits, 1)),
    )


def random_rollout(space: SearchSpace, state: ShardingState, rng: np.random.Generator, depth: int):
    """Apply up to ``depth`` random legal actions; the best score met on the way."""
    best_state, best = state, space.score(state)
    for _ in range(depth):
        legal = space.legal(state)
        if not legal:
            break
        # mostly one of the first few actions (tactics, the largest groups), sometimes any
        pick = int(rng.integers(min(len(legal), 4))) if rng.random() < 0.75 else int(rng.integers(len(legal)))
        nxt = space.apply(state, legal[pick])
        if nxt.key() == state.key():
            continue
        state = nxt
        got = space.score(state)
        if better(got, best):
            best_state, best = state, got
    return best_state, best


def widen(visits: int) -> int:
    """Progressive widening: a node with n visits may have up to 1 + 2 sqrt(n) children, so the
    search goes deep along good lines instead of trying every one of dozens of first actions."""
    return 1 + int(2 * math.sqrt(visits))


def select(root: Node, exploration: float, select_fn: SelectFn) -> list[Node]:
    path = [root]
    node = root
    while node.children and not (node.untried and len(node.children) < widen(node.visits)):
        node = select_fn(node, exploration)
        path.append(node)
    return path


def expand(space: SearchSpace, node: Node, rng: np.random.Generator) -> Node:
    """Add one child; actions that change nothing (a tactic with nothing to do) are dropped."""
    while node.untried:
        # the untried actions are in the space's order (tactics, then the largest groups):
        # try the first few in random order, so that big decisions are explored first
        action = node.untried.pop(int(rng.integers(min(len(node.untried), 3))))
        state = space.apply(node.state, action)
        if state.key() == node.state.key():
            continue
        child = Node(state, node.actions + (action,), space.legal(state))
        node.children[action] = child
        return child
    return node


def backup(path: list[Node], reward: float) -> None:
    for node in path:
        node.visits += 1
        node.value += reward


@dataclasses.dataclass(frozen=True)
class MCTS:
    """UCT search; deterministic for a seed.

    The first episodes score the tactic compositions (``seed_tactics``). The fastest of them
    that fits sets a ceiling (``expert_ceiling``, see ``search/ceiling.py``): the answer sends no
    more bytes and holds no more memory than that expert plan, and replaces it only when faster,
    or, within ``tie_tolerance`` of it, clearly leaner. The result's ``notes`` name the plan.

    After the episodes the best plan is polished (one improving action at a time), then swept
    (:func:`search.greedy.sweep`: every parameter group over a mesh axis at once, from it and
    the fastest seeds), and last refined exactly (:func:`search.ilp.refine`: one more action per
    group, all decided together by the pairwise model) when that costs at most ``refine_work``
    plans times ops. Sweeps and refinement take the steps that only pay off together.

    >>> import search
    >>> search.MCTS(episodes=8, seed=0).episodes
    8
    """

    episodes: int = 48
    seed: int = 0
    time_budget_s: float | None = None
    exploration: float = 0.5
    rollout_depth: int = 2
    select_fn: SelectFn = uct_select
    rollout_fn: RolloutFn = random_rollout
    polish_steps: int = 4  # greedy one-move improvements of the best plan after the episodes
    refine_work: int = 10**6  # the exact last step (search.ilp.refine) runs within this many op-evaluations
    sweeps: int = 4  # plans swept over the mesh axes after the episodes (greedy.sweep): the best, the fastest seeds
    seed_tactics: bool = True  # the first episodes try the compositions of tactic macros (one per mesh axis)
    tie_tolerance: float = 0.01  # plans this close to the fastest count as ties: the leanest wins
    expert_ceiling: bool = True  # never send more bytes or hold more memory than the fastest seed (ceiling.py)
    preempt: bool = False  # polishing may also decide one group before the plan's actions (costly: replays)
    progress: bool | None = None  # None: a tqdm bar on a terminal once the search has run progress.BAR_DELAY_S
    name: str = "mcts"

    def __post_init__(self) -> None:
        check_fields(self, {"episodes": 1, "seed": 0, "time_budget_s": 0.0, "exploration": 0.0, "rollout_depth": 0,
                            "polish_steps": 0, "refine_work": 0, "sweeps": 0, "tie_tolerance": 0.0},
                     optional=("time_budget_s",), flags=("seed_tactics", "expert_ceiling", "preempt"))
        for field in ("select_fn", "rollout_fn"):
            if not callable(getattr(self, field)):
                raise TypeError(f"MCTS({field}={getattr(self, field)!r}): {field} must be a function")

    def _polish(self, space: SearchSpace, plan: tuple, better, curve: list) -> tuple:
        """Hill-climb from ``plan`` (state, score, actions): one move at a time."""
        state, score, actions = plan
        for _ in range(self.polish_steps):
            step = best_step(space, state, score, better)
            if step is not None:
                actions, state, score = actions + (step[0],), step[1], step[2]
            elif self.preempt and (moved := best_preemption(space, actions, score, better)) is not None:
                actions, state, score = moved
            else:
                break
            curve.append(score.reward)
        return state, score, actions

    def search(self, space: SearchSpace) -> SearchResult:
        rng = np.random.default_rng(self.seed)
        t0 = time.perf_counter()
        root = Node(space.root, (), space.legal(space.root))
        ceiling: Ceiling | None = None

        def better(a: Score, b: Score) -> bool:  # noqa: F811  (ranks under the ceiling)
            return ranked(a, ceiling) > ranked(b, ceiling)

        best_state, best = space.root, space.score(space.root)
        best_actions: tuple[Move, ...] = ()
        curve = []
        seeds = tactic_compositions(space, limit=self.episodes // 2) if self.seed_tactics else []
        progress = Progress(self.episodes, self.progress)  # the seeds are episodes too
        grown = [n for seq in seeds if (n := _grow(space, root, seq)) is not None]
        expert = _fastest(space, [root] + grown) if self.expert_ceiling and grown else None
        if expert is not None:
            ceiling = _ceiling_of(space, expert)
        for leaf in grown:
            leaf_score = space.score(leaf.state)
            if better(leaf_score, best):
                best_state, best, best_actions = leaf.state, leaf_score, leaf.actions
            backup(_path(root, leaf.actions), backed_up(leaf_score, ceiling))
            curve.append(best.reward)
            progress.episode(best.reward)
        episodes = len(seeds)
        for episodes in range(len(seeds) + 1, self.episodes + 1):
            path = select(root, self.exploration, self.select_fn)
            leaf = expand(space, path[-1], rng)
            if leaf is not path[-1]:
                path.append(leaf)
            end_state, end = self.rollout_fn(space, leaf.state, rng, self.rollout_depth)
            leaf_score = space.score(leaf.state)
            if better(leaf_score, best):
                best_state, best, best_actions = leaf.state, leaf_score, leaf.actions
            if better(end, best):
                best_state, best = end_state, end
                best_actions = leaf.actions + _actions_between(space, leaf.state, end_state)
            backup(path, max(backed_up(end, ceiling), backed_up(leaf_score, ceiling)))
            curve.append(best.reward)
            progress.episode(best.reward)
            if self.time_budget_s is not None and time.perf_counter() - t0 > self.time_budget_s:
                break
            if not root.untried and not root.children:
                break
        progress.step("polish", episodes)
        plan = self._polish(space, (best_state, best, best_actions), better, curve)
        # then sweep it and the fastest seeds (over the budget too: a sweep shards more) over the
        # mesh axes, and polish what the sweeps found, if they found better
        progress.step("sweep", episodes)
        fastest = sorted(grown, key=lambda n: space.score(n.state).time_s)
        swept = _best_sweep(space, [(plan[0], plan[2])] + [(n.state, n.actions) for n in fastest], self.sweeps,
                            better)
        if swept is not None and better(swept[1], plan[1]):
            plan = self._polish(space, swept, better, curve)
        progress.step("refine", episodes)
        if self.refine_work:  # last, the exact step: every group one more action, decided together
            from search.ilp import refine

            refined = refine(space, plan, ceiling, self.refine_work)
            if refined is not None and better(refined[1], plan[1]):
                plan = refined
        progress.close()
        best_state, best, best_actions = plan
        anchor = None if expert is None else (expert.state, space.score(expert.state), expert.actions)
        best_state, best, best_actions = leanest_tie(root, (best_state, best, best_actions), self.tie_tolerance,
                                                     space, ceiling, anchor)
        stats = SearchStats(episodes, space.evaluations, time.perf_counter() - t0, space.eval_time_s, tuple(curve))
        notes = () if ceiling is None else (
            f"held to the bytes sent ({ceiling.wire_bytes / 2**20:.2f} MiB) and memory "
            f"({ceiling.peak_bytes / 2**20:.1f} MiB) per device of the fastest expert plan: {ceiling.source}",)
        return SearchResult(best_state, best, best_actions, stats, self.name, notes,
                            _alternatives(space, root, best_state, anchor, ceiling))


def _alternatives(space: SearchSpace, root: Node, answer: ShardingState, anchor: tuple | None,
                  ceiling: Ceiling | None) -> tuple[tuple[str, ShardingState, Score], ...]:
    """The final candidates besides the answer: the expert ceiling plan and the tree's next best
    feasible plan (by rank under the ceiling)."""
    out, seen = [], {answer.key()}
    if anchor is not None and anchor[1].feasible and anchor[0].key() not in seen:
        out.append((f"expert ceiling ({ceiling.source if ceiling else 'fastest seed'})", anchor[0], anchor[1]))
        seen.add(anchor[0].key())
    best, stack = None, [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        got = space.score(node.state)
        if got.feasible and node.state.key() not in seen and (best is None or ranked(got, ceiling) > ranked(best[1], ceiling)):
            best = (node.state, got)
    if best is not None:
        out.append(("next best", best[0], best[1]))
    return tuple(out)


def _best_sweep(space: SearchSpace, plans: list[tuple[ShardingState, tuple[Move, ...]]], limit: int,
                better) -> tuple[ShardingState, Score, tuple[Move, ...]] | None:
    """The best plan (by ``better``) among the sweeps (:func:`search.greedy.sweep`) of the first
    ``limit`` distinct ``plans`` over each mesh axis, and then the other axes on top."""
    best = None
    for state, actions in list({s.key(): (s, a) for s, a in plans}.values())[:limit]:
        for order in itertools.permutations(space.axes):
            end, moves = state, actions
            for axis in order:
                more, end, got = sweep(space, end, axis)
                moves += more
                if best is None or better(got, best[1]):
                    best = (end, got, moves)
    return best


def tactic_compositions(space: SearchSpace, limit: int) -> list[tuple[Move, ...]]:
    """The plans an expert composes from tactics: on each free mesh axis one of the macros
    (data parallel, Megatron, FSDP) or none, axes in mesh order; fewest tactics first, at most
    ``limit``. Seeding the tree with them makes the search at least as good as each of them.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.cost import Topology
    >>> from automap.shardings import ShardingState
    >>> from search.space import SearchSpace
    >>> from tactics import PlanContext
    >>> prog = lower(jax.make_jaxpr(lambda w, x: w - (x @ w))(jnp.ones((8, 8)), jnp.ones((8, 8))), ["w", "x"], ["w"])
    >>> axes = {"data": 2, "model": 2}
    >>> space = SearchSpace(ShardingState.initial(prog, axes), topology=Topology.preset("cpu-sim"),
    ...                     context=PlanContext(prog, axes, (prog.inputs[1],), (prog.inputs[0],)))
    >>> seeds = tactic_compositions(space, limit=100)
    >>> len(seeds), [f"{a.tactic}({a.axis})" for a in seeds[-1]]  # 3 x 3 pairs + 2 x 3 singles
    (15, ['fsdp(data)', 'fsdp(model)'])
    >>> expert_ceiling(space).source  # this tiny step is fastest unsharded: nothing may be sent
    'the plan before the search'
    >>> from search.ilp import combinations, starts  # the exact solver's starts: the root and each seed
    >>> len(starts(space)), len(combinations(space))  # compositions that make the same plan are one start
    (16, 4)
    """
    if not space.macros or not space.axes:
        return []
    options = [[()] + [(TacticAction(m, axis),) for m in space.macros] for axis in space.axes]
    combos = [sum(c, ()) for c in itertools.product(*options)]
    return sorted((c for c in combos if c), key=len)[:limit]


def expert_ceiling(space: SearchSpace) -> Ceiling | None:
    """The ceiling :class:`MCTS` holds its answer to: the bytes sent and the memory of the fastest
    feasible plan among the tactic compositions and the root (the plan before the search; None
    without tactics or when none of them fits). Give it to
    ``search.ILP(ceiling=...)`` to solve the same problem exactly (example: at the end of
    :func:`tactic_compositions`'s, which builds a space with tactics).
    """
    root = Node(space.root, (), space.legal(space.root))
    seeds = tactic_compositions(space, limit=4 ** len(space.axes))
    grown = [n for seq in seeds if (n := _grow(space, root, seq)) is not None]
    expert = _fastest(space, [root] + grown) if grown else None
    return None if expert is None else _ceiling_of(space, expert)


def _fastest(space: SearchSpace, nodes: list[Node]) -> Node | None:
    """The node of the fastest feasible plan (the first of equals), or None."""
    fitting = [n for n in nodes if space.score(n.state).feasible]
    return min(fitting, key=lambda n: space.score(n.state).time_s) if fitting else None


def _ceiling_of(space: SearchSpace, node: Node) -> Ceiling:
    score = space.score(node.state)
    source = " + ".join(space.describe(a) for a in node.actions) or "the plan before the search"
    return Ceiling(score.estimate.wire_bytes, score.peak_bytes, source)


def _grow(space: SearchSpace, root: Node, actions: tuple[Move, ...]) -> Node | None:
    """The node reached from ``root`` by ``actions``, adding the nodes missing on the way;
    actions that change nothing are skipped; None when an action is not legal there."""
    node = root
    for action in actions:
        if action in node.children:
            node = node.children[action]
            continue
        if action not in node.untried:
            return None
        state = space.apply(node.state, action)
        if state.key() == node.state.key():
            continue
        node.untried.remove(action)
        node.children[action] = child = Node(state, node.actions + (action,), space.legal(state))
        node = child
    return None if node is root else node


def _path(root: Node, actions: tuple[Move, ...]) -> list[Node]:
    path = [root]
    for a in actions:
        path.append(path[-1].children[a])
    return path


def leanest_tie(root: Node, best: tuple[ShardingState, Score, tuple[Move, ...]], tolerance: float,
                space: SearchSpace, ceiling: Ceiling | None = None,
                anchor: tuple[ShardingState, Score, tuple[Move, ...]] | None = None,
                ) -> tuple[ShardingState, Score, tuple[Move, ...]]:
    """Among the tree's feasible plans within ``tolerance`` of the best estimated time (and under
    ``ceiling``, when given), the one that sends the fewest bytes, then holds the least memory.
    Estimates closer than that are below the cost model's resolution; bytes and memory are what
    it predicts best.

    ``anchor`` (the fastest expert plan), when it is in that band, is the answer unless a plan is
    clearly leaner: ``tolerance`` fewer bytes and no more memory, or ``tolerance`` less memory
    and no more bytes. A plan that differs from the expert's by less than the model resolves is
    not worth the risk that the compiled program disagrees.

    ``best`` and ``anchor`` are (state, score, actions); the answer has the same form. With
    ``tolerance=0`` only exact ties in time can replace ``best`` (``tests/search/test_search.py``
    runs this on a real tree).
    """
    state, score, actions = best
    if tolerance <= 0 or not score.feasible:
        return best
    limit = score.time_s * (1 + tolerance)
    leaner_than_anchor = None
    if anchor is not None and anchor[1].feasible and anchor[1].time_s <= limit:
        state, score, actions = anchor
        wire, peak = anchor[1].estimate.wire_bytes, anchor[1].peak_bytes

        def leaner_than_anchor(s: Score) -> bool:
            w, p = s.estimate.wire_bytes, s.peak_bytes
            return (w <= wire * (1 - tolerance) and p <= peak) or (p <= peak * (1 - tolerance) and w <= wire)

    def lean(s: Score) -> tuple:
        return round(s.estimate.wire_bytes), s.peak_bytes, s.time_s

    stack = [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        got = space.score(node.state)
        admitted = (ceiling is None or ceiling.admits(got)) and (leaner_than_anchor is None or leaner_than_anchor(got))
        if got.feasible and admitted and got.time_s <= limit and lean(got) < lean(score):
            state, score, actions = node.state, got, node.actions
    return state, score, actions


def _actions_between(space: SearchSpace, start: ShardingState, end: ShardingState) -> tuple[Move, ...]:
    """The rollout's actions, recovered from the decision labels added after ``start``."""
    out = []
    state = start
    while state.key() != end.key():  # replay: the first legal action that leads towards ``end``
        for a in space.legal(state):
            nxt = space.apply(state, a)
            if all(end.specs.get(v) == spec for v, spec in nxt.specs.items()):
                out.append(a)
                state = nxt
                break
        else:
            break
    return tuple(out)
