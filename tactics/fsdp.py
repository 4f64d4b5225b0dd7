"""``fsdp(axis)`` and ``zero(stage, axis)``: shard the training state over the data-parallel axis.

The roles of the state are read off the program's structure, never off names:

- *parameters* are the state inputs read by forward-phase ops (directly, or through the region
  input a ``scan``/``cond``/``while`` maps them to);
- *optimizer state* is every other state input (read only by optimizer-phase ops);
- *gradients* are the backward-phase values read by optimizer-phase ops.

A leaf is split along its largest dim that the axis size divides and that is *free*: not tiled
yet (e.g. by an earlier ``megatron``) and not a stacked layers dim (one that a user's factor rule
blocks, as the ``scan`` link does for the stacked dim of its xs). Over several axes jointly
(``fsdp(('data', 'model'))``) each leaf's leading free dim is the alternative, kept where the cost
model estimates it leaner: a small head's largest dim is often its contracted one, and on held-out
``eqx_conv_gru`` (a GRU's last state into an 8-class head) that split came to 174,352 B per device
by XLA's measure against 78,536 B on the leading dims. The optimizer's elementwise ops tie each
optimizer-state leaf's dims to its parameter's (the *optimizer classes* below), so a
moment takes its parameter's dim, and a stacked dim of a parameter is also kept whole in its
moments.

Every stage splits the batch on the axis first (``data_parallel``, unless the batch is split on
it already) so that the state's layout is a later decision: where a parameter's layout and the
batch disagree at a matmul, the batch wins and the parameter is gathered (FSDP), instead of the
activations being resharded.

===========  ==============  ===============  =========================
stage        parameters      gradients        optimizer state
===========  ==============  ===============  =========================
``zero(1)``  replicated      all-reduced      sharded
``zero(2)``  replicated      reduce-scattered sharded
``zero(3)``  sharded         reduce-scattered sharded (= ``fsdp``)
===========  ==============  ===============  =========================
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Literal

from automap.cost.estimate import estimate
from automap.ir.program import Program
from automap.propagate import apply
from automap.report import human_bytes
from automap.shardings import Action, ShardingError, ShardingState, check_action
from automap.xla_layout import xla_layout
from tactics.base import PlanContext, TacticResult, off_mesh
from tactics.data_parallel import DataParallel
from tactics.flow import consumers, region_links

Stage = Literal[1, 2, 3]
Dim = tuple[int, int]  # (value id, dim)


@dataclasses.dataclass(frozen=True)
class StateRoles:
    """Value ids of the parameters, the optimizer state and the gradients, in program order."""

    params: tuple[int, ...]
    opt_state: tuple[int, ...]
    grads: tuple[int, ...]


def state_roles(ctx: PlanContext) -> StateRoles:
    """Split the state inputs into parameters and optimizer state, and find the gradients.

    >>> import jax, jax.numpy as jnp, automap
    >>> def step(state, x):
    ...     w, m = state
    ...     loss, g = jax.value_and_grad(lambda w: jnp.tanh(x @ w).sum())(w)
    ...     m = 0.9 * m + g
    ...     return (w - 0.1 * m, m), loss
    >>> plan = automap.partition(step, mesh=automap.make_mesh({"data": 2})).plan(
    ...     (jnp.ones((4, 8)), jnp.ones((4, 8))), jnp.ones((2, 4)))
    >>> w, m, x = plan.program.inputs
    >>> roles = state_roles(PlanContext(plan.program, {"data": 2}, (x,), (w, m)))
    >>> roles.params == (w,), roles.opt_state == (m,), len(roles.grads)
    (True, True, 1)
    """
    key = ("state_roles", ctx.state_inputs)  # structure: the same for every state
    if key not in ctx.program.memo:
        ctx.program.memo[key] = _state_roles(ctx)
    return ctx.program.memo[key]


def _state_roles(ctx: PlanContext) -> StateRoles:
    program = ctx.program
    users = consumers(program)
    links = {op.id: region_links(op) for op in program.all_ops if op.regions}

    def forward_read(vid: int, seen: set[int]) -> bool:
        if vid in seen:
            return False
        seen.add(vid)
        for op, _ in users.get(vid, ()):
            if not op.regions:
                if op.phase == "forward":
                    return True
                continue
            if any(forward_read(r, seen) for o, r in links[op.id] if o == vid):
                return True
        return False

    params = tuple(v for v in ctx.state_inputs if forward_read(v, set()))
    opt_state = tuple(v for v in ctx.state_inputs if v not in set(params))
    grads = tuple(dict.fromkeys(
        v for op in program.all_ops if op.phase == "optimizer" and not op.regions
        for v in op.linked_inputs if program.values[v].phase == "backward"
    ))
    return StateRoles(params, opt_state, grads)


def _optimizer_classes(program: Program) -> dict[Dim, Dim]:
    """(value, dim) -> a representative: dims that share a factor in an optimizer-phase op (a
    moment's dim and its parameter's dim, through the update's elementwise ops) are one class."""
    parent: dict[Dim, Dim] = {}

    def find(k: Dim) -> Dim:
        parent.setdefault(k, k)
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for op in program.all_ops:
        if op.phase != "optimizer" or op.regions:
            continue
        by_factor: dict[int, Dim] = {}
        rule = op.rule
        for vid, dims in zip(op.linked_inputs + op.linked_outputs, rule.operands + rule.results, strict=True):
            for d, fs in enumerate(dims):
                if fs:
                    first = by_factor.setdefault(fs[0], (vid, d))
                    parent[find((vid, d))] = find(first)
    return {k: find(k) for k in list(parent)}


def _blocked(program: Program, values: tuple[int, ...], classes: dict[Dim, Dim]) -> set[Dim]:
    """Dims of ``values`` a user's rule keeps whole (a stacked layers dim), spread over classes."""
    users = consumers(program)
    hit: set[Dim] = set()
    for vid in values:
        for op, pos in users.get(vid, ()):
            for d, fs in enumerate(op.rule.operands[pos]):
                if not fs or op.rule.factors[fs[0]].kind == "blocked":
                    hit.add((vid, d))
    roots = {classes.get(k, k) for k in hit}
    return hit | {k for k, r in classes.items() if r in roots}


def _free_dims(state: ShardingState, vid: int, size: int, blocked: set[Dim]) -> list[int]:
    value = state.program.values[vid]
    spec = state.spec(vid)
    return [d for d in range(value.ndim) if not spec[d] and (vid, d) not in blocked and value.shape[d] % size == 0]


def _largest(state: ShardingState, vid: int, free: list[int]) -> int:
    shape = state.program.values[vid].shape
    return max(free, key=lambda d: (shape[d], -d))


def _leading(state: ShardingState, vid: int, free: list[int]) -> int:
    return free[0]


DimChoice = Callable[[ShardingState, int, list[int]], int]


def _picks(program: Program, state: ShardingState, state_inputs: tuple[int, ...], roles: StateRoles,
           size: int, choose: DimChoice = _largest) -> dict[int, int]:
    """State input -> the dim it is split along. A parameter takes the free divisible dim
    ``choose`` picks (its largest by default; also in stages 1 and 2, where only its moments use
    the choice); an optimizer-state leaf takes the dim its parameter took (the same optimizer
    class), else its own the same way."""
    key = ("fsdp_classes", state_inputs)  # structure: the same for every state
    if key not in program.memo:
        classes = _optimizer_classes(program)
        program.memo[key] = (classes, _blocked(program, state_inputs, classes))
    classes, blocked = program.memo[key]
    picks: dict[int, int] = {}
    chosen: set[Dim] = set()
    for vid in roles.params:
        if free := _free_dims(state, vid, size, blocked):
            picks[vid] = d = choose(state, vid, free)
            chosen.add(classes.get((vid, d), (vid, d)))
    for vid in roles.opt_state:
        linked = [d for d in _free_dims(state, vid, size, set()) if classes.get((vid, d), (vid, d)) in chosen]
        free = linked or _free_dims(state, vid, size, blocked)
        if free:
            picks[vid] = linked[0] if linked else choose(state, vid, free)
    return picks


@dataclasses.dataclass(frozen=True)
class Zero:
    """ZeRO stage ``stage`` on mesh axis ``axis``, or jointly on a tuple of axes (each leaf's one
    dim split over all of them, as ``P(('data', 'model'))`` writes it); build with :func:`zero` or
    :func:`fsdp`."""

    stage: Stage
    axis: str | tuple[str, ...]
    name: str = "zero"

    @property
    def axes(self) -> tuple[str, ...]:
        return (self.axis,) if isinstance(self.axis, str) else tuple(self.axis)

    @property
    def tag(self) -> str:
        return f"fsdp({self.axis!r})" if self.name == "fsdp" else f"zero({self.stage}, {self.axis!r})"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        tag, axes = self.tag, self.axes
        for axis in axes:
            if missing := off_mesh(ctx, state, axis, tag):
                return missing
        program = ctx.program
        roles = state_roles(ctx)
        notes: list[str] = []
        reasons: dict[int, str] = {}
        before = state
        for axis in axes:  # the batch over each axis in order (joining its dim, as data_parallel does)
            if not any(axis in a for v in ctx.data_inputs for a in state.spec(v)):
                dp = DataParallel(axis)(ctx, state)
                state = dp.state
                notes.extend(dp.notes)
                for vid, why in dp.reasons.items():
                    reasons.setdefault(vid, why)
        size = math.prod(ctx.axes[a] for a in axes)
        picks = _picks(program, state, ctx.state_inputs, roles, size)
        targets = roles.opt_state + (roles.params if self.stage == 3 else ())
        actions, small, already = self._actions(program, state, targets, picks, notes, reasons)
        if not actions:
            why = "already sharded on the axis" if already else f"no free dim divisible by {size}"
            return TacticResult(before, (f"{tag}: no state leaf to shard ({why}); nothing done",))
        freeze: tuple[int, ...] = ()
        if self.stage < 3:
            freeze = roles.params + (roles.grads if self.stage == 1 else ())
        split = apply(state, actions, freeze=freeze, label=tag)
        leading = _picks(program, state, ctx.state_inputs, roles, size, _leading) if len(axes) > 1 else picks
        if leading != picks:  # over several axes, the cost model picks between the largest and the leading dims
            more_notes, more_reasons = [], dict(reasons)
            other = self._actions(program, state, targets, leading, more_notes, more_reasons)[0]
            other_split = apply(state, other, freeze=freeze, label=tag)
            largest_peak, leading_peak = _leanest_peak(split), _leanest_peak(other_split)
            if leading_peak < largest_peak:
                split, actions, reasons = other_split, other, more_reasons
                notes.extend(more_notes)
                notes.append(f"{tag}: each leaf's leading free dim, not its largest: {human_bytes(leading_peak)} "
                             f"per device by estimate against {human_bytes(largest_peak)}")
        state = split
        done = {a.value for a in actions}
        n_params = len(done & set(roles.params))
        n_opt = len(done) - n_params
        on = f"{axes[0]!r}" if len(axes) == 1 else f"{axes} jointly"
        notes.append(f"{tag}: {n_params} parameters and {n_opt} optimizer-state leaves sharded on {on}"
                     if self.stage == 3 else
                     f"{tag}: {n_opt} optimizer-state leaves sharded on {on}; parameters replicated, gradients "
                     + ("all-reduced" if self.stage == 1 else "reduce-scattered"))
        if small:
            notes.append(f"{tag}: {small} small leaves replicated on {on} (no free dim divisible by {size})")
        return TacticResult(state, tuple(notes), reasons=reasons)

    def _actions(self, program: Program, state: ShardingState, targets: tuple[int, ...], picks: dict[int, int],
                 notes: list[str], reasons: dict[int, str]) -> tuple[list[Action], int, int]:
        """(the actions splitting each target along its pick over every axis, how many targets
        have no pick, how many are sharded on an axis already); skips and reasons are recorded."""
        actions, small, already = [], 0, 0
        for vid in targets:
            if any(axis in a for a in state.spec(vid) for axis in self.axes):
                already += 1
                continue
            if vid not in picks:
                small += 1
                continue
            leaf = [Action(vid, picks[vid], axis) for axis in self.axes]
            try:
                for i, action in enumerate(leaf):  # each axis joins the dim the ones before it split
                    check_action(program, state.axes, _joined(state.spec(vid), leaf[:i]), action)
            except ShardingError as e:  # defensive: the pick only takes free, divisible dims
                notes.append(f"{self.tag} skips {program.values[vid].name}: {e}")
                continue
            actions.extend(leaf)
            reasons[vid] = f"{self.tag}: dim {picks[vid]} of {program.values[vid].ndim}"
        return actions, small, already


def _leanest_peak(state: ShardingState) -> int:
    """The estimated peak memory per device of ``state`` compiled as the leaner of its two
    programs (what :mod:`automap.arbiter` chooses between): pinned as planned, or laid out by XLA's
    propagation from the inputs alone. A leaf's split dim rarely changes the planned layout (the
    batch wins at each use, the leaf is gathered) but can change the one XLA propagates."""
    return min(estimate(state).peak_memory_bytes, estimate(xla_layout(state)).peak_memory_bytes)


def _joined(spec: tuple[tuple[str, ...], ...], done: list[Action]) -> tuple[tuple[str, ...], ...]:
    """``spec`` after ``done`` (actions on one value), each axis appended to its dim's."""
    out = list(spec)
    for a in done:
        out[a.dim] = out[a.dim] + (a.axis,)
    return tuple(out)


def zero(stage: Stage, axis: str = "data") -> Zero:
    """ZeRO on mesh axis ``axis`` with data parallelism on the same axis: stage 1 shards the
    optimizer state, stage 2 also the gradients (reduce-scattered), stage 3 also the parameters
    (gathered where the forward and backward passes use them). See the module docstring.

    >>> import jax, jax.numpy as jnp, automap
    >>> def step(state, x):
    ...     w, m = state
    ...     loss, g = jax.value_and_grad(lambda w: jnp.tanh(x @ w).sum())(w)
    ...     m = 0.9 * m + g
    ...     return (w - 0.1 * m, m), loss
    >>> mesh = automap.make_mesh({"data": 2})
    >>> args = (jnp.ones((4, 8)), jnp.ones((4, 8))), jnp.ones((2, 4))
    >>> plan = automap.partition(step, mesh=mesh, tactics=[zero(1)]).plan(*args)
    >>> [plan.state.spec(v) for v in plan.program.inputs]  # w replicated, m sharded, batch split
    [((), ()), ((), ('data',)), (('data',), ())]
    """
    if stage not in (1, 2, 3):
        raise ValueError(f"zero stage must be 1, 2 or 3, got {stage!r}")
    return Zero(stage, axis)


def fsdp(axis: str | tuple[str, ...] = "data") -> Zero:
    """Fully sharded data parallelism (ZeRO-3) on mesh axis ``axis``: every parameter and
    optimizer-state leaf split along its largest free dim the axis divides, the batch split on
    the same axis, activations kept batch-sharded (the weights are gathered where they are used).
    A tuple of axes is ZeRO-3 over all of them jointly, as an expert writes it for the whole mesh:
    the batch dim over each in order, and each leaf's one dim that the product of their sizes
    divides split over all of them (``schedule(fsdp('data'), fsdp('model'))`` splits two dims).

    >>> import jax, jax.numpy as jnp, automap
    >>> def step(w, x):
    ...     loss, g = jax.value_and_grad(lambda w: jnp.tanh(x @ w).sum())(w)
    ...     return w - 0.1 * g, loss
    >>> mesh = automap.make_mesh({"data": 2})
    >>> plan = automap.partition(step, mesh=mesh, tactics=[fsdp("data")]).plan(jnp.ones((4, 8)), jnp.ones((2, 4)))
    >>> [plan.state.spec(v) for v in plan.program.inputs]
    [((), ('data',)), (('data',), ())]
    >>> plan.reasons[plan.program.inputs[0]]
    "fsdp('data'): dim 1 of 2"
    >>> mesh = automap.make_mesh({"data": 2, "model": 2})
    >>> plan = automap.partition(step, mesh=mesh, tactics=[fsdp(("data", "model"))]).plan(
    ...     jnp.ones((4, 8)), jnp.ones((4, 4)))
    >>> [plan.state.spec(v) for v in plan.program.inputs]
    [((), ('data', 'model')), (('data', 'model'), ())]
    """
    return Zero(3, axis if isinstance(axis, str) else tuple(axis), name="fsdp")
