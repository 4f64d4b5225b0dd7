"""The search space: folded decision groups, their legal actions, and the reward of a state.

An action tiles one dim of every value of a decision group on one mesh axis (one decision for
all identical layers), then propagates. The reward is the root's estimated step time over the
state's (higher is better); a state over the per-device memory budget is infeasible and its
reward is shaped by ``(budget / peak) ** 2`` so that the search can climb back under it.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import time
from typing import Any, Callable, NamedTuple, Sequence, Union

from automap.cost import Estimate, Topology, estimate
from automap.ir.fold import fold
from automap.ir.program import Program
from automap.propagate import apply
from automap.shardings import Action, ShardingError, ShardingState


@dataclasses.dataclass(frozen=True, order=True)
class GroupAction:
    """Tile ``dim`` of every value in decision group ``group`` on mesh axis ``axis``."""

    group: int
    dim: int
    axis: str


@dataclasses.dataclass(frozen=True, order=True)
class TacticAction:
    """Apply a structural tactic (``data_parallel``, ``megatron``, ``fsdp``) on mesh axis ``axis``:
    one decision that stands for many group actions (PartIR's composite strategies). A tuple of
    axes is ``fsdp`` over them jointly (:func:`search.compose.whole_mesh_fsdp`; never in the beam,
    whose moves are ordered by axis name)."""

    tactic: str
    axis: str | tuple[str, ...]


Move = Union[GroupAction, TacticAction]
MACROS: dict[str, Callable[[str], Any]] = {}
FASTEST = 8  # states kept (fastest first) for what follows a search that fits nothing (recomputation)


def _macros() -> dict[str, Callable[[str], Any]]:
    if not MACROS:
        import tactics

        MACROS.update(data_parallel=tactics.data_parallel, megatron=tactics.megatron, fsdp=tactics.fsdp,
                      expert_parallel=tactics.expert_parallel, sequence_parallel=tactics.sequence_parallel,
                      expert_parallel_tokens_whole=functools.partial(tactics.expert_parallel, tokens=False))
    return MACROS


def macro_names() -> tuple[str, ...]:
    """The tactic macros a search may offer, by name (a searcher's ``macros`` chooses among them).

    >>> macro_names()
    ('data_parallel', 'megatron', 'fsdp', 'expert_parallel', 'sequence_parallel', 'expert_parallel_tokens_whole')
    """
    return tuple(_macros())


# expert parallelism both ways: GShard's (the tokens split over the experts' axis too, all-to-alls at
# the dispatch and combine) and, once the batch is split over another axis, with the tokens whole on
# the experts' axis (each device routes every token of its batch shard: no all-to-all); the objective
# picks (keras-hub's Mixtral on 2x4: the latter with data parallelism is the hand plan, 1229 us
# against 1285 us for the best plan the search found without it)
DEFAULT_MACROS = ("data_parallel", "megatron", "fsdp", "expert_parallel", "expert_parallel_tokens_whole",
                  "sequence_parallel")
EXPERT_MACROS = ("expert_parallel", "expert_parallel_tokens_whole")
CALLED_AS = {"expert_parallel_tokens_whole": ("expert_parallel", "tokens=False")}  # a macro's name in plan notes
REFINES = {"sequence_parallel": "megatron"}  # a macro that refines another's regions on the same axis


@dataclasses.dataclass(frozen=True)
class Score:
    reward: float
    time_s: float
    peak_bytes: int
    feasible: bool
    estimate: Estimate


class Plan(NamedTuple):
    """A plan the search met: its state, score and the moves that make it from the root."""

    state: ShardingState
    score: Score
    moves: tuple[Move, ...]


def decision_values(program: Program, state: ShardingState) -> list[int]:
    """Inputs the search may tile: data inputs and parameters (state read by forward ops),
    not frozen by a tactic, with at least one dim. Optimizer state follows its parameter."""
    readers = program.users
    out = []
    for v in program.inputs:
        value = program.values[v]
        if v in state.frozen or value.ndim == 0:
            continue
        ops = readers.get(v, ())
        if ops and not any(op.phase in ("forward",) for op in ops):
            continue  # read by the optimizer only
        out.append(v)
    return list(dict.fromkeys(out))


def significant(
    program: Program, groups: Sequence[tuple[int, ...]], data_inputs: Sequence[int], min_share: float
) -> list[tuple[int, ...]]:
    """Groups worth a decision, largest first: groups of data inputs (the batch) always, and
    parameter groups holding at least ``min_share`` of the largest group's bytes (a layer
    norm's scale is left to follow its layer by propagation)."""
    data = set(data_inputs)
    size = {g: sum(program.values[v].nbytes for v in g) for g in groups}
    largest = max(size.values(), default=0)
    keep = [g for g in groups if size[g] >= min_share * largest or any(v in data for v in g)]
    return sorted(keep, key=lambda g: -size[g])


def _blocked_dims(program: Program, vid: int) -> set[int]:
    """Dims of ``vid`` that some op keeps whole (the stacked layers dim of a scan, a sorted dim)."""
    out = set()
    for op in program.users.get(vid, ()):
        rule = op.rule
        for v, dims in zip(op.linked_inputs + op.linked_outputs, rule.operands + rule.results, strict=True):
            if v != vid:
                continue
            for d, fs in enumerate(dims):
                if fs and rule.factors[fs[0]].kind == "blocked":
                    out.add(d)
    return out


def used_axes(state: ShardingState, axes: Sequence[str]) -> set[str]:
    """The axes some spec of ``state`` holds, of ``axes`` (the scan stops once all are found)."""
    used: set[str] = set()
    for spec in state.specs.values():
        for dim in spec:
            if dim:
                used.update(dim)
        if used.issuperset(axes):
            break
    return used.intersection(axes)


class SearchSpace:
    """Decision groups over a root state, with cached scoring (a transposition table)."""

    def __init__(
        self,
        root: ShardingState,
        *,
        topology: Topology,
        memory_budget: int | None = None,
        groups: Sequence[tuple[int, ...]] | None = None,
        donated: Sequence[int] = (),
        data_inputs: Sequence[int] = (),
        min_share: float = 0.02,
        context: Any = None,
        macros: Sequence[str] = DEFAULT_MACROS,
        emitted_layout: Callable[[ShardingState], ShardingState] | None = None,
    ):
        self.root = root
        # state -> the layout its program compiles to (the state itself where it is pinned as planned):
        # :meth:`emitted_score` prices the final candidates there
        self.emitted_layout = emitted_layout
        self._emitted: dict[frozenset, Score] = {}
        self.program = root.program
        self.topology = topology
        self.memory_budget = memory_budget
        self.donated = tuple(donated)
        values = decision_values(self.program, root)
        if groups is None:
            groups = significant(self.program, fold(self.program, values), data_inputs, min_share)
        self.groups = tuple(groups)
        self.blocked = {v: _blocked_dims(self.program, v) for g in self.groups for v in g}
        self.axes = tuple(a for a, n in root.axes.items() if n > 1)
        links = topology.links_for(root.axes)
        # axes of one size over one link are interchangeable while no value uses them
        self.axis_class = {a: (root.axes[a], links.get(a)) for a in self.axes}
        self.context = context  # a tactics.PlanContext: enables tactic macro-actions
        self.macros = tuple(macros) if context is not None else ()
        self._macro_results: dict[tuple, ShardingState | None] = {}
        self._scores: dict[frozenset, Score] = {}
        self.fastest: list[tuple[float, int, ShardingState]] = []  # (-time, order, state): the FASTEST fastest scored
        self.memo: dict[str, Any] = {}  # what a stage computes once per space (the compositions)
        self.evaluations = 0
        self.eval_time_s = 0.0
        self.base_time: float | None = None
        self.base_time = self.score(root).time_s

    def group_name(self, g: int) -> str:
        names = [self.program.values[v].name for v in self.groups[g]]
        return names[0] + (f" (+{len(names) - 1} alike)" if len(names) > 1 else "")

    def describe(self, action: Move) -> str:
        if isinstance(action, TacticAction):  # as the tactic is called (``tactics.expert_parallel(axis, tokens=False)``)
            called, *extra = CALLED_AS.get(action.tactic, (action.tactic,))
            return f"{called}({', '.join([repr(action.axis), *extra])})"
        return f"{self.group_name(action.group)} dim {action.dim} on {action.axis!r}"

    def _macro(self, state: ShardingState, action: TacticAction) -> ShardingState | None:
        """The state after the tactic, or None when it changes nothing (memoised)."""
        key = (state.key(), action)
        if key not in self._macro_results:
            result = _macros()[action.tactic](action.axis)(self.context, state).state
            self._macro_results[key] = None if result.key() == state.key() else result
        return self._macro_results[key]

    def legal(self, state: ShardingState) -> list[Move]:
        """Every action that changes the state and keeps every spec valid, in a fixed order:
        tactic macro-actions first, then group actions, largest groups first. (The candidates
        are found once per state; a macro is dropped once it was run there and changed nothing.)"""
        candidates = state.memo.get(("search.legal", self))
        if candidates is None:
            candidates = state.memo[("search.legal", self)] = self._candidates(state)
        results, key = self._macro_results, state.key()
        # a macro lazily: run when chosen (a no-op then leads nowhere new)
        return [a for a in candidates if a.__class__ is not TacticAction or results.get((key, a), a) is not None]

    def _candidates(self, state: ShardingState) -> list[Move]:
        out: list[Move] = []
        used = used_axes(state, self.axes)
        axes = self.open_axes(state)
        for name in self.macros:
            for axis in axes:
                if self.offered(name, axis, state, used):
                    out.append(TacticAction(name, axis))
        for g, members in enumerate(self.groups):
            rep = self.program.values[members[0]]
            for d in range(rep.ndim):
                if any(d in self.blocked[v] for v in members):
                    continue
                for axis in axes:
                    try:
                        for v in members:
                            state.check_action(Action(v, d, axis))
                    except ShardingError:
                        continue
                    out.append(GroupAction(g, d, axis))
        return out

    def offered(self, name: str, axis: str, state: ShardingState, used: set[str] | None = None) -> bool:
        """Whether macro ``name`` on ``axis`` is worth a move in ``state``, from the structure alone
        (a macro that would change nothing is not offered: the compositions' beam budget goes to
        those that do). A tactic claims a free axis, except: fsdp may join any (data
        parallelism's), megatron may join expert parallelism's (the dense layers of a MoE model:
        the vocab-parallel embedding and head), and sequence parallelism only joins megatron's
        (Megatron-LM's, on the tensor-parallel axis). Expert parallelism (either way: ``EXPERT_MACROS``)
        needs experts; with the tokens whole on its axis, the batch split over another (the hand
        layout; alone, every device of the axis would route the whole batch). ``used``:
        the axes some spec of ``state`` holds (computed when not given)."""
        if used is None:
            used = used_axes(state, self.axes)
        macros = _macros()
        if name == "sequence_parallel":
            return macros[name](axis).applies(self.context, state)
        if name in EXPERT_MACROS:
            tactic = macros[name](axis)
            return (axis not in used and tactic.applies(self.context, state)
                    and (tactic.tokens or tactic.batch_elsewhere(self.context, state)))
        if axis not in used or name == "fsdp":
            return True
        return (name == "megatron" and macros["expert_parallel"](axis).holds(self.context, state)
                and macros[name](axis).applies(self.context, state))

    def open_axes(self, state: ShardingState) -> tuple[str, ...]:
        """The axes a move may take in ``state``: of the axes of one size and link that sit in the
        same places (the same dims of the same values; a free axis sits nowhere), the first; the
        others would make the same plans with the axes renamed. So a mesh of many like axes
        branches as one of few, free or used alike (two axes that both carry the batch count once)."""
        if len(set(self.axis_class.values())) == len(self.axes):
            return self.axes  # no two axes alike: each is open (and the places need no scan of every spec)
        got = state.memo.get("search.open_axes")
        if got is None:
            places: dict[str, list] = {a: [] for a in self.axes}
            for v, spec in state.specs.items():
                for d, dim in enumerate(spec):
                    for a in dim:
                        if a in places:  # not an axis of size 1
                            places[a].append((v, d))
            first: dict[tuple, str] = {}
            got = state.memo["search.open_axes"] = tuple(
                a for a in self.axes if first.setdefault((self.axis_class[a], frozenset(places[a])), a) == a)
        return got

    def apply(self, state: ShardingState, action: Move) -> ShardingState:
        if isinstance(action, TacticAction):
            got = self._macro(state, action)
            return state if got is None else got
        actions = [Action(v, action.dim, action.axis) for v in self.groups[action.group]]
        return apply(state, actions, label=f"search: {self.describe(action)}")

    def _raw(self, state: ShardingState) -> Score:
        t0 = time.perf_counter()
        est = estimate(state, self.topology, donated=self.donated)
        self.evaluations += 1
        self.eval_time_s += time.perf_counter() - t0
        peak = est.peak_memory_bytes
        feasible = self.memory_budget is None or peak <= self.memory_budget
        reward = (self.base_time / est.time_s) if self.base_time else 1.0
        if not feasible:
            reward *= (self.memory_budget / peak) ** 2
        return Score(reward, est.time_s, peak, feasible, est)

    def score(self, state: ShardingState) -> Score:
        key = state.key()
        got = self._scores.get(key)
        if got is None:
            got = self._scores[key] = self._raw(state)
            entry = (-got.time_s, self.evaluations, state)  # the slowest on top, to be dropped first
            if len(self.fastest) < FASTEST:
                heapq.heappush(self.fastest, entry)
            elif entry > self.fastest[0]:
                heapq.heapreplace(self.fastest, entry)
        return got

    def emitted_score(self, state: ShardingState) -> Score:
        """The score of the program ``state`` compiles to: :meth:`score` where the plan pins its
        layout, else the score of the layout XLA gives it (``emitted_layout``: a plan that decided
        only its inputs pins nothing, :func:`automap.emit.pinned_values`, and compiles to what
        ``jax.jit`` makes of its shardings, :mod:`automap.xla_layout`). Too dear for every state
        (the model of XLA's propagation costs 10-30 estimates), it prices the final candidates."""
        laid = state if self.emitted_layout is None else self.emitted_layout(state)
        if laid is state:
            return self.score(state)
        key = state.key()
        if key not in self._emitted:
            self._emitted[key] = self._raw(laid)
        return self._emitted[key]

    def rescore(self, state: ShardingState) -> Score:
        """:meth:`emitted_score` for a state its key does not identify (a recomputing program, whose
        copies' ids may recur in another one): not cached. The program it compiles to is priced,
        as a recomputing plan is measured against the budget: held-out hk_resnet's answer pins
        nothing, and its own layout (kernels gathered for its 1x1 maps) was estimated 269,904 B
        against XLA's 103,616 B (101,712 B in the layout XLA gives it), so no recomputation of it
        fitted by estimate."""
        laid = state if self.emitted_layout is None else self.emitted_layout(state)
        return self._raw(laid)

    def fastest_states(self) -> list[ShardingState]:
        """The fastest states scored so far (at most ``FASTEST``), fastest first, fitting or not."""
        return [state for _, _, state in sorted(self.fastest, reverse=True)]
