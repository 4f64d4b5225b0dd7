"""``sequence_parallel(axis)``: Megatron-LM sequence parallelism, found from the structure of the program.

Between the tensor-parallel regions that :func:`tactics.megatron` finds (a column-parallel
contraction and the row-parallel one it pairs with), the activations are whole on the tensor
axis: the layer norms, dropout and residual adds run redundantly on every device of it, and the
row contraction's partial sum is all-reduced. Sequence parallelism splits those regions on the
*sequence* dim over the same axis, so the row contraction's all-reduce becomes a reduce-scatter
(to the sequence-split layout) and the next column contraction's input is all-gathered from it;
the same bytes go over the wire, and the activations between the regions take ``1/n`` of the memory.

The sequence dim is found, not named: it is a free dim of the activation operand of a column (or
vocab-parallel head) contraction, or of a row contraction's result, that the flow of a data
input's non-batch dim reaches (the token dim besides the batch, see
:func:`tactics.data_parallel.batch_dims`), never a batch dim. The decision tiles it on those
activations, fenced in the activations: the weights, what is computed from them alone, what is
computed from the data alone (token ids, masks), the program's inputs (unless one is itself such
an activation) and outputs keep their specs, as propagation does not carry the sequence split
into them; the fence is lifted after the decision. The vocab-parallel embedding keeps megatron's
layout (its output all-reduced, then split on the sequence; its gradient gathered before the
scatter into the table): split on the sequence, XLA all-gathers the table instead. A region
whose weight is not tiled on the axis (no ``megatron`` on it before) is left alone.

In a scanned model the embedding's gradient is a result of the backward ``scan``; emission pins
scan results like any other value, so XLA compiles the planned layout there too (zoo ``gpt_nnx``
with ``scan=True``, 2x4: 113,146 B sent per device against 111,930 B estimated; left unpinned, XLA
kept it split on the sequence and gathered the table, 132,346 B).
"""
from __future__ import annotations

import dataclasses

from automap.ir.program import Op, Program
from automap.propagate import apply
from automap.shardings import Action, ShardingState
from tactics.base import PlanContext, TacticResult, off_mesh, refusal
from tactics.data_parallel import batch_dims
from tactics.flow import consumers, derived, follow, weight_derived
from tactics.megatron import candidates_of


@dataclasses.dataclass(frozen=True)
class SequenceDim:
    value: int  # an activation at the boundary of a tensor-parallel region
    dim: int
    where: str  # "column input" | "row output" | "head input"
    op: Op
    weight: int  # the weight whose tiling on the axis makes the tensor-parallel region


def token_dims(program: Program, ctx: PlanContext) -> tuple[frozenset, frozenset]:
    """((value, dim) the batch reaches, (value, dim) the data inputs' other dims reach), forwards."""
    key = ("batch_dims", ctx.data_inputs, ctx.state_inputs)  # shared with data_parallel
    if key not in program.memo:
        program.memo[key] = batch_dims(ctx)
    batch = program.memo[key]
    weights = weight_derived(program, ctx.state_inputs)
    users = consumers(program)
    on_batch: set[tuple[int, int]] = set()
    other: set[tuple[int, int]] = set()
    for vid in ctx.data_inputs:
        for d in range(program.values[vid].ndim):
            (on_batch if batch.get(vid) == d else other).update(follow(program, vid, d, weights, users=users).visited)
    return frozenset(on_batch), frozenset(other - on_batch)


def _free_dims(op: Op, pos: int, weights: set[int]) -> list[int]:
    """Dims of linked value ``pos`` of a contraction whose factor is parallel and no weight carries."""
    rule = op.rule
    if op.linked[pos] in weights:
        return []
    weight_factors = {fs[0] for i, v in enumerate(op.linked_inputs) if v in weights for fs in rule.operands[i] if fs}
    dims = (rule.operands + rule.results)[pos]
    return [d for d, fs in enumerate(dims)
            if fs and rule.factors[fs[0]].kind == "parallel" and fs[0] not in weight_factors]


def find_sequence_dims(program: Program, ctx: PlanContext) -> tuple[list[SequenceDim], list[str]]:
    """The sequence dim of every activation entering or leaving a tensor-parallel region."""
    candidates = candidates_of(ctx)[0]
    weights = weight_derived(program, ctx.state_inputs)
    on_batch, tokens = token_dims(program, ctx)
    boundary: list[tuple[Op, int, str, int]] = []  # (op, linked position, where, weight)
    for c in candidates:
        if c.kind == "embedding":  # left in megatron's layout: see _fence
            continue
        acts = [i for i, v in enumerate(c.op.linked_inputs) if v not in weights]
        boundary += [(c.op, i, f"{c.kind} input", c.weight) for i in acts]
        boundary += [(r, len(r.linked_inputs), "row output", c.weight) for r in c.rows]
    found: list[SequenceDim] = []
    why_not: list[str] = []
    seen: set[int] = set()
    for op, pos, where, weight in boundary:
        vid = op.linked[pos]
        if vid in seen:
            continue
        seen.add(vid)
        dims = [d for d in _free_dims(op, pos, weights)
                if (vid, d) in tokens and (vid, d) not in on_batch and program.values[vid].shape[d] > 1]
        if not dims:
            why_not.append(f"{where} {program.values[vid].name}: no token dim besides the batch")
            continue
        found.append(SequenceDim(vid, max(dims, key=lambda d: program.values[vid].shape[d]), where, op, weight))
    return found, why_not


def sequence_dims(ctx: PlanContext) -> tuple[list[SequenceDim], list[str]]:
    """:func:`find_sequence_dims`, once per program (structure: the same for every state)."""
    key = ("sequence_dims", ctx.data_inputs, ctx.state_inputs)
    if key not in ctx.program.memo:
        ctx.program.memo[key] = find_sequence_dims(ctx.program, ctx)
    return ctx.program.memo[key]


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """The tactic :func:`sequence_parallel` makes: the axis, and the regions found once per program."""

    axis: str
    name: str = "sequence_parallel"

    def applies(self, ctx: PlanContext, state: ShardingState) -> bool:
        """Whether it would change ``state``: some tensor-parallel region on the axis (its weight
        tiled on it, as :func:`tactics.megatron` leaves it) has a boundary activation whose
        sequence dim may still take the axis. The search offers it as a macro only then."""
        return any(any(self.axis in axes for axes in state.spec(s.weight))
                   and refusal(state, Action(s.value, s.dim, self.axis), "", "") is None
                   for s in sequence_dims(ctx)[0])

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        program, tag = ctx.program, f"sequence_parallel({self.axis!r})"
        if missing := off_mesh(ctx, state, self.axis, tag):
            return missing
        dims, why_not = sequence_dims(ctx)
        if not dims:
            reason = "; ".join(why_not[:3]) or "no tensor-parallel region (megatron finds no column/row pair)"
            return TacticResult(state, (f"{tag}: no sequence dim found ({reason}); nothing done",))
        notes, actions, reasons = [], [], {}
        for s in dims:
            action = Action(s.value, s.dim, self.axis)
            what = f"{s.where} {program.values[s.value].name}"
            if not any(self.axis in axes for axes in state.spec(s.weight)):
                notes.append(f"{tag} skips {what}: {program.values[s.weight].name} is not tensor-parallel on "
                             f"{self.axis!r} (put megatron({self.axis!r}) before it)")
                continue
            skip = refusal(state, action, tag, what)
            if skip:
                notes.append(skip)
                continue
            actions.append(action)
            reasons[s.value] = f"{tag}: sequence dim {s.dim}"
        if not actions:
            return TacticResult(state, tuple(notes) + (f"{tag}: every sequence dim skipped; nothing done",))
        notes.append(f"{tag}: sequence dim of {len(actions)} activations between tensor-parallel regions, e.g. "
                     + ", ".join(f"{program.values[a.value].name}[{a.dim}]" for a in actions[:3]))
        # the activations only: the weights (and their state) and the data inputs keep their layout
        fence = _fence(program, ctx) - state.frozen - {a.value for a in actions}
        state = apply(state, actions, freeze=fence, label=tag)
        state = state.replace(frozen=state.frozen - fence)
        return TacticResult(state, tuple(notes), reasons=reasons)


def _fence(program: Program, ctx: PlanContext) -> frozenset[int]:
    """What the decision leaves alone: the weights and what is computed from them alone (the
    position embeddings), what is computed from the data and constants alone (the token ids a
    lookup reads, masks, positions), the program's inputs and outputs, and the vocab-parallel
    embedding: its output and, in the backward pass, the gradient a scatter by the token ids
    adds into the table's (with either split on the sequence over the table's axis, XLA's
    partitioner all-gathers the table and all-reduces its whole gradient)."""
    key = ("sequence_fence", ctx.data_inputs, ctx.state_inputs)
    if key not in program.memo:
        weights, constants = derived(program, ctx.state_inputs)
        data = derived(program, ctx.data_inputs)[0]
        held = weights | constants | data | set(program.inputs) | set(program.outputs)
        for c in candidates_of(ctx)[0]:
            if c.kind == "embedding":
                held.update(c.op.outputs)
        for op in program.all_ops:  # the lookup's transpose: a scatter by the token ids
            if op.phase != "forward" and op.primitive.startswith("scatter") and any(v in data for v in op.inputs):
                held.update(op.inputs)
        program.memo[key] = frozenset(held)
    return program.memo[key]


def sequence_parallel(axis: str = "model") -> SequenceParallel:
    """Megatron-LM sequence parallelism on mesh axis ``axis`` (the tensor-parallel axis): the
    layer-norm, dropout and residual regions between the column/row pairs of
    :func:`tactics.megatron` are split on their sequence dim (found from the data flow, see the
    module docstring), turning each row contraction's all-reduce into a reduce-scatter and the
    next column contraction's input into an all-gather. Put it after ``megatron`` on the same axis.

    >>> import jax, jax.numpy as jnp, automap, tactics
    >>> def loss(params, x):  # x: (batch, seq, features)
    ...     h = x + jnp.tanh(x @ params["up"]) @ params["down"]
    ...     return (h * h).sum()
    >>> def step(params, x):
    ...     value, g = jax.value_and_grad(loss)(params, x)
    ...     return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value
    >>> params = {"up": jnp.ones((4, 8)), "down": jnp.ones((8, 4))}
    >>> sp = tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model"), sequence_parallel("model"))
    >>> step = automap.partition(step, mesh=automap.make_mesh({"data": 2, "model": 2}), tactics=[sp], search=None)
    >>> plan = step.plan(params, jnp.ones((2, 4, 4)))
    >>> [plan.state.spec(v) for v in plan.program.inputs]  # down row-, up column-parallel; x: batch, sequence
    [(('model',), ()), ((), ('model',)), (('data',), ('model',), ())]
    >>> down = [op for op in plan.program.all_ops if op.primitive == "dot_general"][1]
    >>> plan.state.spec(down.outputs[0])  # the row output: reduce-scattered to the sequence split
    (('data',), ('model',), ())
    >>> plan.xla_lays_out  # only inputs decided: estimated in the layout XLA's propagation gives
    True
    >>> sorted({(c.kind, c.bytes) for c in plan.estimate.collectives if c.axes == ("model",)})  # and the loss
    [('all-gather', 128), ('all-reduce', 4), ('reduce-scatter', 128)]
    """
    return SequenceParallel(axis)
