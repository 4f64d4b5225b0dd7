"""``megatron(axis)``: tensor parallelism found from the structure of the program.

A *column-parallel* weight is one whose output feature, followed forward through the factor
rules, only ever ends in a contraction with another weight (the *row-parallel* one): through
elementwise work (GELU, SwiGLU's product, bias adds), reshapes, and attention, where the heads
factor is a batch factor of the score and value contractions. Tiling the column weight's
feature on ``axis`` is the whole decision; propagation shards the row weight's contraction dim,
the biases and every activation in between, and the row contraction leaves a partial sum (the
one all-reduce per pair). A weight whose output feature ends only in reductions (the loss's
softmax over the vocabulary) is a *vocab-parallel head*; a weight looked up by ``gather`` is a
*vocab-parallel embedding*. Weights are processed in program order and each is used once, so a
stack of dense layers pairs up column, row, column, row.

A convolution pairs as a dot does (found from its factor rule, not its name): its kernel's output
features are a column split, and a following convolution (or dot) contracting them is the row,
its input features split and its result a partial sum; the spatial dims stay whole.
"""
from __future__ import annotations

import dataclasses

from automap.ir.program import Op, Program
from automap.propagate import apply
from automap.rules import traits_of
from automap.shardings import Action, ShardingState
from tactics.base import PlanContext, TacticResult, off_mesh, refusal
from tactics.flow import consumers, derived, follow

# the contractions megatron pairs: a conv's output / input features are a dot's column / row split
PAIRED = frozenset({"matmul", "convolution"})


@dataclasses.dataclass(frozen=True)
class Candidate:
    kind: str  # "column" | "head" | "embedding"
    op: Op
    weight: int  # the weight-derived value tiled
    dim: int
    rows: tuple[Op, ...] = ()  # contractions the column pairs with


def _label(program: Program, op: Op) -> str:
    return op.name or f"{op.primitive}#{op.id}"


def _free_dims(op: Op, pos: int) -> list[tuple[int, int, int]]:
    """(operand dim, result dim) of operand ``pos`` of a dot whose factor reaches the result."""
    rule = op.rule
    out = []
    for d, fs in enumerate(rule.operands[pos]):
        if not fs or rule.factors[fs[0]].kind != "parallel":
            continue
        for rd, rfs in enumerate(rule.results[0]):
            if rfs and rfs[0] == fs[0]:
                out.append((d, rd, rule.factors[fs[0]].size))
    return out


def find_candidates(program: Program, state_inputs: tuple[int, ...]) -> tuple[list[Candidate], list[str]]:
    """Column/row pairs, heads and embeddings, in program order, each weight used once."""
    weights, constants = derived(program, state_inputs)
    users = consumers(program)
    used: set[int] = set()
    found: list[Candidate] = []
    why_not: list[str] = []
    for op in program.all_ops:
        if op.phase != "forward":
            continue
        traits = traits_of(op.primitive)
        if traits.lookup is not None:
            table, indices = op.inputs[traits.lookup.table], op.inputs[traits.lookup.indices]
            if indices not in weights and indices not in constants and table in weights:  # by data (tokens)
                rule = op.rule
                for d, fs in enumerate(rule.operands[traits.lookup.table]):
                    if fs and rule.factors[fs[0]].kind == "reduction" and table not in used:
                        found.append(Candidate("embedding", op, table, d))
                        used.add(table)
            continue
        if traits.contraction is None or traits.contraction.kind not in PAIRED:
            continue
        w_pos = [i for i, v in enumerate(op.inputs) if v in weights]
        if len(w_pos) != 1:
            continue
        pos = w_pos[0]
        weight = op.inputs[pos]
        if weight in used:
            continue
        best = None
        for d, rd, size in sorted(_free_dims(op, pos), key=lambda t: -t[2]):
            flow = follow(program, op.outputs[0], rd, weights, users=users, contractions=PAIRED)
            kinds = flow.kinds() - {"mix_weight"}
            rows = tuple(dict.fromkeys(flow.ops("contract_weight")))
            if kinds == {"contract_weight"} and not any(other_weight(r, weights) in used for r in rows):
                best = Candidate("column", op, weight, d, rows)
                break
            if kinds == {"reduce"} and best is None:
                best = Candidate("head", op, weight, d)
            elif best is None:
                why_not.append(f"{_label(program, op)} dim {d}: ends in {sorted(kinds)}")
        if best is None:
            continue
        found.append(best)
        used.add(weight)
        for r in best.rows:
            used.add(other_weight(r, weights))
    return _without_bypasses(program, found, weights, users, why_not), why_not


def _without_bypasses(program: Program, found: list[Candidate], weights: set[int], users, why_not: list[str]):
    """The candidates less each column whose row contractions feed another pair's row: a low-rank
    bypass inside that pair's column region (LoRA's ``x @ A @ B`` added to ``x @ W``). Its pair
    would make ``B``'s result a partial sum all-reduced inside the region; left alone, ``B`` takes
    the region's tiling on its output feature from propagation and ``A`` stays whole."""
    rows_of = {id(c): {r.id for r in c.rows} for c in found if c.kind == "column"}
    kept = []
    for c in found:
        others = set().union(*(ids for key, ids in rows_of.items() if key != id(c))) if c.kind == "column" else set()
        fed = {end.id for r in c.rows for _, rd, _ in _free_dims(r, r.inputs.index(other_weight(r, weights)))
               for end in follow(program, r.outputs[0], rd, weights, users=users,
                                 contractions=PAIRED).ops("contract_weight")}
        if fed & others:
            why_not.append(f"{_label(program, c.op)}: a bypass feeding another pair's row, left to propagation")
            continue
        kept.append(c)
    return kept


def other_weight(op: Op, weights: set[int]) -> int:
    return next(v for v in op.inputs if v in weights)


def candidates_of(ctx: PlanContext) -> tuple[list[Candidate], list[str]]:
    """:func:`find_candidates`, once per program (structure: the same for every state)."""
    key = ("megatron_candidates", ctx.state_inputs)
    if key not in ctx.program.memo:
        ctx.program.memo[key] = find_candidates(ctx.program, ctx.state_inputs)
    return ctx.program.memo[key]


@dataclasses.dataclass(frozen=True)
class Megatron:
    axis: str
    name: str = "megatron"

    def applies(self, ctx: PlanContext, state: ShardingState) -> bool:
        """Whether some candidate weight may still be tiled on the axis (the search asks before it
        offers megatron on an axis another tactic holds)."""
        return any(refusal(state, Action(c.weight, c.dim, self.axis), "", "") is None
                   for c in candidates_of(ctx)[0])

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        program = ctx.program
        if missing := off_mesh(ctx, state, self.axis, f"megatron({self.axis!r})"):
            return missing
        candidates, why_not = candidates_of(ctx)
        actions, notes = [], []
        for c in candidates:
            action = Action(c.weight, c.dim, self.axis)
            why_not = refusal(state, action, f"megatron({self.axis!r})", f"{c.kind} {_label(program, c.op)}")
            if why_not:
                notes.append(why_not)
                continue
            actions.append(action)
            if c.kind == "column":
                rows = ", ".join(_label(program, r) for r in c.rows)
                notes.append(f"megatron({self.axis!r}): column {_label(program, c.op)} paired with row {rows}")
            else:
                notes.append(f"megatron({self.axis!r}): vocab-parallel {c.kind} {_label(program, c.op)}")
        if not actions:
            if candidates:
                return TacticResult(state, tuple(notes) + (f"megatron({self.axis!r}): every candidate skipped; nothing done",))
            reason = "; ".join(why_not[:3]) or "no contraction with a weight"
            return TacticResult(state, tuple(notes) + (f"megatron({self.axis!r}): no matmul chain found ({reason})",))
        state = apply(state, actions, label=f"megatron({self.axis!r})")
        return TacticResult(state, tuple(notes))


def megatron(axis: str = "model") -> Megatron:
    """Megatron tensor parallelism on mesh axis ``axis``: column-parallel then row-parallel
    matmul pairs, heads over attention heads, vocab-parallel embedding and output head.

    >>> import jax, jax.numpy as jnp, automap
    >>> def loss(params, x):
    ...     return (jnp.tanh(x @ params["up"]) @ params["down"]).sum()
    >>> def step(params, x):
    ...     value, g = jax.value_and_grad(loss)(params, x)
    ...     return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value
    >>> mesh = automap.make_mesh({"model": 2})
    >>> params = {"up": jnp.ones((4, 8)), "down": jnp.ones((8, 4))}
    >>> plan = automap.partition(step, mesh=mesh, tactics=[megatron("model")]).plan(params, jnp.ones((2, 4)))
    >>> [plan.state.spec(v) for v in plan.program.inputs[:2]]  # down: row-parallel, up: column-parallel
    [(('model',), ()), ((), ('model',))]
    """
    return Megatron(axis)
