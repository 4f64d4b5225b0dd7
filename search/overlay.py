"""A move made again on a state its propagation cannot tell apart from the one it was made on.

Propagation (:func:`automap.propagate.apply`) reads only the specs and priorities of the values
linked by the ops it runs: the users of the values it changes. A move made on ``before`` that
reads none of the values where ``state`` differs from ``before`` runs the same ops to the same
solutions on ``state``, so it changes the same values in the same way; only its own priority
differs, and it is the latest in both states, so every comparison of priorities (all that the
factor solver does with them) comes out the same. :func:`overlay` then writes the move's
changes onto ``state`` instead of propagating again. :class:`Replayer` does so for the exact
step's pairs of options (:func:`search.ilp.refine`): a pair whose second option's propagation
reads nothing the first changed costs no propagation of its own.
"""
from __future__ import annotations

import dataclasses

from typing import TYPE_CHECKING

from automap.analysis import note_derived
from automap.shardings import ShardingError, ShardingState

if TYPE_CHECKING:
    from search.space import Move, SearchSpace


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What one move did to ``before`` (making ``after``): the values whose spec it changed and
    the values the ops it ran link (what its propagation read)."""

    before: ShardingState
    after: ShardingState
    changed: frozenset[int]
    read: frozenset[int]


def footprint(before: ShardingState, after: ShardingState) -> Footprint | None:
    """The footprint of the move that made ``after`` from ``before`` (one decision: one priority
    more), or None when its priority does not come after that of every tiled dim of ``before``
    (then a later priority may compare otherwise)."""
    if after.next_priority != before.next_priority + 1 or after.frozen != before.frozen or not _latest(before):
        return None
    changed = differing(before, after)
    users = before.program.users_of
    read = set(changed)
    for v in changed:
        for op in users[v]:
            read.update(op.linked)
    return Footprint(before, after, frozenset(changed), frozenset(read))


def _latest(state: ShardingState) -> bool:
    """Whether a decision made on ``state`` comes after every one it holds: every priority is
    below the next one, and every tiled dim has one (the solver takes a missing one as 0)."""
    got = state.memo.get("search.overlay.latest")
    if got is None:
        p, prio = state.next_priority, state.priority
        got = state.memo["search.overlay.latest"] = max(prio.values(), default=-1) < p and all(
            (v, d) in prio for v, spec in state.specs.items() for d, axes in enumerate(spec) if axes)
    return got


def differing(a: ShardingState, b: ShardingState) -> set[int]:
    """The values whose spec or priority differs between two states of one program.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.propagate import apply
    >>> from automap.shardings import Action
    >>> prog = lower(jax.make_jaxpr(lambda x, y: (jnp.tanh(x), y * 2))(jnp.ones((4, 4)), jnp.ones((4, 4))),
    ...              ["x", "y"], ["a", "b"])
    >>> root = ShardingState.initial(prog, {"data": 2})
    >>> x = prog.inputs[0]
    >>> sorted(differing(root, apply(root, [Action(x, 0, "data")]))) == sorted({x, prog.outputs[0]})
    True
    """
    out = {v for v, _ in a.key().symmetric_difference(b.key())}
    out.update(v for (v, _), p in a.priority.items() if b.priority.get((v, _)) != p)
    out.update(v for (v, _), p in b.priority.items() if a.priority.get((v, _)) != p)
    return out


def overlay(move: Footprint, state: ShardingState, differs: set[int] | frozenset[int]) -> ShardingState | None:
    """The state the move of ``move`` makes from ``state``, which differs from ``move.before`` in
    the values ``differs`` (and comes later: a higher next priority, the same frozen values);
    None when the move's propagation reads one of them (then it must run)."""
    before, after = move.before, move.after
    p, q = before.next_priority, state.next_priority
    if q < p or state.frozen != before.frozen or not move.read.isdisjoint(differs):
        return None
    specs, prio = dict(state.specs), dict(state.priority)
    for v in move.changed:
        if v in after.specs:
            specs[v] = after.specs[v]
        else:
            specs.pop(v, None)
    for key, at in after.priority.items():
        if key[0] in move.changed:
            prio[key] = at + (q - p) if at >= p else at  # the move's own priority is q here
    labels = dict(state.labels)
    labels[q] = after.labels[p]
    out = state.replace(specs=specs, priority=prio, next_priority=q + 1, labels=labels)
    out.inherit_key(state, move.changed)
    note_derived(out, state, move.changed)
    return out


class Replayer:
    """:func:`search.greedy.replay` that remembers the prefixes it ran: a pair of options then
    costs one propagation after the first option's, not a replay from the root. With ``start``
    (moves from the root), each move made right after it leaves its footprint, and the move
    made again after other moves from there is written over them instead of propagated, where
    its propagation cannot see them (:func:`search.overlay.overlay`)."""

    def __init__(self, space: SearchSpace, start: tuple[Move, ...] | None = None) -> None:
        self.space, self.start = space, start
        self.prefixes: dict[tuple[Move, ...], tuple[ShardingState, tuple[Move, ...]]] = {(): (space.root, ())}
        self.footprints: dict[Move, Footprint | None] = {}  # move -> what it did right after start
        self.differs: dict[tuple[Move, ...], set[int]] = {}  # kept prefix -> where it differs from start's state

    def __call__(self, moves: tuple[Move, ...], keep: bool = False) -> tuple[ShardingState, tuple[Move, ...]]:
        got = self.prefixes.get(moves)
        if got is None:
            state, done = self(moves[:-1], keep=True)
            after = self._overlaid(moves)
            if after is None:
                try:
                    after = self.space.apply(state, moves[-1])
                except ShardingError:
                    after = state
                if moves[:-1] == self.start and after is not state:
                    self.footprints[moves[-1]] = footprint(state, after)
            got = (after, done + (moves[-1],)) if after.key() != state.key() else (state, done)
            if keep:
                self.prefixes[moves] = got
        return got

    def _overlaid(self, moves: tuple[Move, ...]) -> ShardingState | None:
        """The state ``moves`` make, written from the footprint of their last move after start,
        when their prefix extends start and that move's propagation cannot see the difference."""
        start, prefix = self.start, moves[:-1]
        move = self.footprints.get(moves[-1]) if start is not None and len(prefix) > len(start) else None
        if move is None or prefix[:len(start)] != start:
            return None
        differs = self.differs.get(prefix)
        if differs is None:
            differs = self.differs[prefix] = differing(self.prefixes[start][0], self.prefixes[prefix][0])
        return overlay(move, self.prefixes[prefix][0], differs)
