"""Monte Carlo tree search over sharding actions (UCT), in the style of mctx: the phases are
separate functions (select, expand, rollout, backup) and the policies are injected.

A node holds a sharding state; its children are the states after one more move (a tactic macro
on a mesh axis, or a group action). The value of an episode is the best value (by the objective)
met on its path (a plan may stop at any node), so a node's mean value estimates how good the plans
below it are. Scores are cached per state by the space (a transposition table), so states reached
along different orders of moves are evaluated once.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

import numpy as np

from automap.shardings import ShardingState
from search.objective import Objective
from search.space import GroupAction, Move, Plan, Score, SearchSpace


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


SelectFn = Callable[[Node, float], Node]
RolloutFn = Callable[[SearchSpace, ShardingState, np.random.Generator, int], tuple[ShardingState, Score]]


def uct_select(node: Node, exploration: float) -> Node:
    """The child maximising mean value + exploration * sqrt(ln N / n) (ties: first in order)."""
    log_n = math.log(max(node.visits, 1))
    return max(
        node.children.values(),
        key=lambda c: c.mean + exploration * math.sqrt(log_n / max(c.visits, 1)),
    )


def random_rollout(space: SearchSpace, state: ShardingState, rng: np.random.Generator, depth: int,
                   objective: Objective = Objective()):
    """Apply up to ``depth`` random legal actions; the best plan met on the way (by ``objective``)."""
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
        if objective.better(got, best):
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


def backup(path: list[Node], value: float) -> None:
    for node in path:
        node.visits += 1
        node.value += value


def grow(space: SearchSpace, root: Node, actions: tuple[Move, ...]) -> Node | None:
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


def path_to(root: Node, actions: tuple[Move, ...]) -> list[Node]:
    path = [root]
    for a in actions:
        path.append(path[-1].children[a])
    return path


def plans_of(space: SearchSpace, root: Node) -> list[Plan]:
    """Every plan of the tree, depth first."""
    out, stack = [], [root]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        out.append(Plan(node.state, space.score(node.state), node.actions))
    return out


def run_episodes(
    space: SearchSpace, root: Node, objective: Objective, *, episodes: int, rng: np.random.Generator,
    exploration: float, rollout_depth: int, select_fn: SelectFn, rollout_fn: RolloutFn,
    deadline: float | None = None, on_episode: Callable[[Plan], None] = lambda best: None,
) -> Plan:
    """``episodes`` of select, expand, rollout and backup from ``root``; the best plan met (by
    ``objective``), with the moves that make it. Stops early at ``deadline`` (a perf_counter
    time) or when the tree is exhausted."""
    best = Plan(root.state, space.score(root.state), root.actions)
    for _ in range(episodes):
        if not root.untried and not root.children:
            break
        path = select(root, exploration, select_fn)
        leaf = expand(space, path[-1], rng)
        if leaf is not path[-1]:
            path.append(leaf)
        end_state, end = rollout_fn(space, leaf.state, rng, rollout_depth)
        leaf_score = space.score(leaf.state)
        if objective.better(leaf_score, best.score):
            best = Plan(leaf.state, leaf_score, leaf.actions)
        if objective.better(end, best.score):
            best = Plan(end_state, end, leaf.actions + actions_between(space, leaf.state, end_state))
        backup(path, max(objective.value(end), objective.value(leaf_score)))
        on_episode(best)
        if deadline is not None and time.perf_counter() > deadline:
            break
    return best


def actions_between(space: SearchSpace, start: ShardingState, end: ShardingState) -> tuple[Move, ...]:
    """The rollout's actions, recovered from the decision labels added after ``start``."""
    out = []
    state = start
    while state.key() != end.key():  # replay: the first legal action that leads towards ``end``
        for a in space.legal(state):
            if isinstance(a, GroupAction) and not _towards(space, a, end):
                continue  # it tiles a dim on an axis that ``end`` does not: it leads away
            nxt = space.apply(state, a)
            if all(end.specs.get(v) == spec for v, spec in nxt.specs.items()):
                out.append(a)
                state = nxt
                break
        else:
            break
    return tuple(out)


def _towards(space: SearchSpace, action: GroupAction, end: ShardingState) -> bool:
    """Whether ``end`` tiles the action's dim on its axis for every value of its group (a
    state the action leads to does: propagation never takes an axis off)."""
    for v in space.groups[action.group]:
        spec = end.specs.get(v)
        if spec is None or action.axis not in spec[action.dim]:
            return False
    return True
