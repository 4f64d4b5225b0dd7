"""The tactic protocol: a small immutable value whose ``__call__`` maps a sharding state to a
new one (plus notes for the report and the decisions it deliberately left open)."""
from __future__ import annotations

import dataclasses
from typing import Mapping, Protocol, Sequence

from automap.ir.program import Program
from automap.shardings import Action, ShardingError, ShardingState


@dataclasses.dataclass(frozen=True)
class PlanContext:
    """What a tactic may look at besides the state."""

    program: Program
    axes: Mapping[str, int]  # mesh axis -> size
    data_inputs: tuple[int, ...]  # input value ids not returned updated (the batch)
    state_inputs: tuple[int, ...]  # input value ids returned updated (params, optimizer state)


@dataclasses.dataclass(frozen=True)
class TacticResult:
    state: ShardingState
    notes: tuple[str, ...] = ()
    open: tuple[Action, ...] = ()
    reasons: Mapping[int, str] = dataclasses.field(default_factory=dict)  # value id -> why (report)


class Tactic(Protocol):
    name: str

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult: ...


def refusal(state: ShardingState, action: Action, tag: str, what: str) -> str | None:
    """Why ``action`` cannot be taken (a note for the report), or None when it is legal. Values
    pinned by an earlier tactic are refused: the earlier decision stands."""
    if action.value in state.frozen:
        return f"{tag} skips {what}: pinned by an earlier tactic"
    try:
        state.check_action(action)
    except ShardingError as e:
        return f"{tag} skips {what}: {e}"
    return None


def off_mesh(ctx: PlanContext, state: ShardingState, axis: str, tag: str) -> TacticResult | None:
    """The result of a tactic asked for an axis the mesh lacks (the state unchanged, a note), or None."""
    if axis in ctx.axes:
        return None
    return TacticResult(state, (f"{tag}: not a mesh axis {tuple(ctx.axes)}; nothing done",))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Tactics applied in order (like an optax chain): itself a tactic, so schedules nest."""

    tactics: tuple[Tactic, ...]
    name: str = "schedule"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        return run_schedule(self.tactics, ctx, state)


def schedule(*tactics: Tactic) -> Schedule:
    """Compose tactics; earlier ones decide first (their decisions win where two disagree).

    >>> import tactics
    >>> s = tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model"))
    >>> [t.name for t in s.tactics]
    ['data_parallel', 'megatron']
    """
    flat: list[Tactic] = []
    for t in tactics:
        flat.extend(t.tactics if isinstance(t, Schedule) else (t,))
    return Schedule(tuple(flat))


def run_schedule(tactics: Sequence[Tactic], ctx: PlanContext, state: ShardingState) -> TacticResult:
    """Apply tactics in order; notes and open decisions accumulate."""
    notes: list[str] = []
    open_: list[Action] = []
    reasons: dict[int, str] = {}
    for tactic in tactics:
        result = tactic(ctx, state)
        state = result.state
        notes.extend(result.notes)
        open_.extend(result.open)
        for vid, why in result.reasons.items():
            reasons.setdefault(vid, why)
    return TacticResult(state, tuple(notes), tuple(open_), reasons)
