"""``data_parallel(axis)``: split the batch, found from how the data flows, not from positions.

A dim of a data input (an argument the step does not return updated) is a *batch* dim when its
factor, followed forward to the loss, is never contracted, never blocked and never meets a
weight in an elementwise op (a sequence dim meets the position embedding; a feature dim is
contracted with a weight) or a factor that came from a weight (the targets' feature dim meets
the prediction's, produced by the last layer); it may only be reduced (the mean of the loss). Dims of different
inputs that reach a common value are one factor: if one of them is rejected, all are (the
targets' sequence dim meets the tokens' sequence dim in the logits).
"""
from __future__ import annotations

import dataclasses

from automap.propagate import apply
from automap.shardings import Action, ShardingState
from tactics.base import PlanContext, TacticResult, off_mesh, refusal
from tactics.flow import Flow, consumers, follow, weight_derived

_BATCH_ENDS = frozenset({"reduce", "output"})


def batch_dims(ctx: PlanContext) -> dict[int, int]:
    """data input value id -> its batch dim (inputs without one are left out)."""
    program = ctx.program
    weights = weight_derived(program, ctx.state_inputs)
    users = consumers(program)
    # the dims the weights' own dims reach (not those a broadcast of a weight adds, a bias broadcast
    # to its layer's output shape): a data dim meeting one of these meets a weight; see below too
    from_weights: set[tuple[int, int]] = set()
    for vid in ctx.state_inputs:
        for d in range(program.values[vid].ndim):
            from_weights |= follow(program, vid, d, weights, users=users).visited
    weight_dims = frozenset(from_weights)
    flows: dict[tuple[int, int], Flow] = {}
    for vid in ctx.data_inputs:
        for d in range(program.values[vid].ndim):
            flows[(vid, d)] = follow(program, vid, d, weights, users=users, weight_dims=weight_dims)
    keys = list(flows)
    # dims whose flows meet are one factor
    parent = {k: k for k in keys}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    owner: dict[tuple[int, int], tuple[int, int]] = {}
    for k in keys:
        for point in flows[k].visited:
            if point in owner:
                parent[find(k)] = find(owner[point])
            else:
                owner[point] = k
    # a dim that meets a weight's factor anywhere (the prediction's feature dim, which came from
    # the last weight, against the targets' feature dim) is a feature, not the batch
    rejected = {find(k) for k in keys if not flows[k].kinds() <= _BATCH_ENDS or flows[k].visited & from_weights}
    out: dict[int, int] = {}
    for vid, d in keys:
        if find((vid, d)) not in rejected and vid not in out and program.values[vid].shape[d] > 1:
            out[vid] = d
    return out


@dataclasses.dataclass(frozen=True)
class DataParallel:
    axis: str
    name: str = "data_parallel"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        tag = f"data_parallel({self.axis!r})"
        if missing := off_mesh(ctx, state, self.axis, tag):
            return missing
        key = ("batch_dims", ctx.data_inputs, ctx.state_inputs)  # structure: the same for every state
        if key not in ctx.program.memo:
            ctx.program.memo[key] = batch_dims(ctx)
        dims = ctx.program.memo[key]
        if not dims:
            return TacticResult(state, (f"{tag}: no data input has a batch dim (every dim is contracted, "
                                        "blocked or meets a weight); nothing done",))
        actions, notes, reasons = [], [], {}
        program = ctx.program
        for vid in ctx.data_inputs:
            if vid not in dims and program.values[vid].ndim:
                notes.append(f"{tag}: {program.values[vid].name} has no batch dim (every dim is contracted, "
                             "blocked or meets a weight); left whole")
        for vid, d in dims.items():
            action = Action(vid, d, self.axis)
            why_not = refusal(state, action, tag, program.values[vid].name)
            if why_not:
                notes.append(why_not)
                continue
            actions.append(action)
            reasons[vid] = f"{tag}: batch dim {d}"
        if not actions:
            return TacticResult(state, tuple(notes) + (f"{tag}: no batch dim divisible by the axis; nothing done",))
        state = apply(state, actions, label=tag)
        notes.append(f"{tag}: batch dims " + ", ".join(f"{program.values[a.value].name}[{a.dim}]" for a in actions))
        return TacticResult(state, tuple(notes), reasons=reasons)


def data_parallel(axis: str = "data") -> DataParallel:
    """Data parallelism on mesh axis ``axis``: the batch dim of every data input (found from the
    data flow) is split over it; parameters follow by propagation (replicated, gradients
    all-reduced).

    >>> import jax, jax.numpy as jnp, automap
    >>> def step(w, x):  # x is (features, batch): the batch dim is found, not assumed
    ...     loss = lambda w: jnp.tanh(w @ x).sum()
    ...     return w - 0.1 * jax.grad(loss)(w), loss(w)
    >>> plan = automap.partition(step, mesh=automap.make_mesh({"data": 2}), tactics=[data_parallel("data")]).plan(
    ...     jnp.ones((3, 4)), jnp.ones((4, 8)))
    >>> plan.state.spec(plan.program.inputs[1])
    ((), ('data',))
    """
    return DataParallel(axis)
