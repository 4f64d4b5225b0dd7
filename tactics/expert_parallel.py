"""``expert_parallel(axis)``: mixture-of-experts layers found from the structure of the program.

An *expert dim* is a dim of a weight (a value derived from the state alone, see
:mod:`tactics.flow`) that a contraction keeps apart instead of summing it with the activations':

- a **batch** factor of a matmul: a parallel factor the weight shares with the other operand and
  the result (``egcd,edf->egcf``: each expert's tokens meet that expert's weights only), which is
  how a stacked expert weight ``[E, ...]`` is used after an einsum dispatch (GShard, Switch);
- a **group** factor of a matmul: a factor of the weight the rule sums over but that the
  contraction's traits do not list as contracted, and that no other operand carries: the group dim
  of ``jax.lax.ragged_dot``'s right-hand side, where each row of the left-hand side picks one group.

Nothing looks at names, and a scan's stacked ``layers`` dim is not one (a scan slices it; no
contraction keeps it). Two decisions follow:

1. the expert dim of the weights and of the expert-major activations (the dispatched tokens
   ``[E, G, C, D]``, the hidden units, the expert outputs) goes on ``axis``; propagation shards the
   weights' gradients and optimizer state, fenced in :func:`expert_region` so that the expert dim
   never flows back through the dispatch into the routing (router, softmax, masks);
2. with ``tokens=True`` (the default) the batch (as :func:`tactics.data_parallel.batch_dims` finds
   it) goes on ``axis`` too where it divides: GShard's layout, each device of the axis routing its
   own tokens. The expert-major and token-major layouts then meet at the dispatch and combine
   einsums, where an axis moves between dims of a value: :func:`automap.analysis.reshards` prices
   it as an all-to-all, and XLA compiles one.
"""
from __future__ import annotations

import dataclasses

from automap.ir.program import Op, Program
from automap.propagate import apply
from automap.rules import RuleContext, Shaped, traits_of
from automap.shardings import Action, ShardingState
from tactics.base import PlanContext, TacticResult, off_mesh, refusal
from tactics.data_parallel import batch_dims
from tactics.flow import weight_derived


@dataclasses.dataclass(frozen=True)
class ExpertDim:
    kind: str  # "batch" (a dot_general batch dim) | "group" (ragged_dot's group dim)
    op: Op
    weight: int  # the weight-derived operand of the contraction
    dim: int
    size: int
    activations: tuple[tuple[int, int], ...] = ()  # (value, dim) of the tokens' operand and result holding it


def _expert_dims(op: Op, pos: int, contracted: tuple[int, ...]) -> list[tuple[str, int, int, int]]:
    """(kind, operand dim, size, factor) of operand ``pos`` of a matmul: the dims kept per expert."""
    rule = op.rule
    found = []
    for d, fs in enumerate(rule.operands[pos]):
        if not fs:
            continue
        f = fs[0]
        factor = rule.factors[f]
        elsewhere = [i for i, dims in enumerate(rule.operands) if i != pos and any(f in g for g in dims)]
        in_result = any(f in g for dims in rule.results for g in dims)
        if factor.kind == "parallel" and elsewhere and in_result:
            found.append(("batch", d, factor.size, f))
        elif factor.kind == "reduction" and not elsewhere and d not in contracted:
            found.append(("group", d, factor.size, f))
    return found


def find_experts(program: Program, state_inputs: tuple[int, ...]) -> list[ExpertDim]:
    """Every (weight, expert dim) pair in program order, each weight once."""
    weights = weight_derived(program, state_inputs)
    found: list[ExpertDim] = []
    seen: set[int] = set()
    for op in program.all_ops:
        traits = traits_of(op.primitive)
        if op.phase != "forward" or not traits.matmul:
            continue
        contracted = traits.contraction.dims(_context(program, op), **op.params)
        for pos, v in enumerate(op.inputs):
            if v not in weights or v in seen:
                continue
            others = [u for i, u in enumerate(op.inputs) if i != pos]
            if all(u in weights for u in others):  # weight times weight: no tokens routed here
                continue
            rule = op.rule
            for kind, d, size, f in _expert_dims(op, pos, contracted[pos] if pos < len(contracted) else ()):
                acts = tuple((u, ud) for i, (u, dims) in enumerate(zip(op.linked, rule.operands + rule.results,
                                                                      strict=True))
                             if i != pos and u not in weights for ud, fs in enumerate(dims) if fs and fs[0] == f)
                found.append(ExpertDim(kind, op, v, d, size, acts))
                seen.add(v)
                break
    return found


def expert_region(program: Program, experts: list[ExpertDim], *, free_to_result: bool = True) -> frozenset[int]:
    """The values the experts' factor reaches without crossing the dispatch or the combine.

    Walked through the factor rules in every direction from the expert dims (weights, expert-major
    activations), through elementwise work, reshapes and optimizer updates, and through a
    contraction only where the factor is one of its batch factors (in every operand it reaches:
    the expert matmuls and their weight gradients), or, with ``free_to_result``, from an operand
    whose free dim it is to the result (the gradient of the combine mask stays expert-major). It
    stops where the expert factor is summed (the combine, the gradient of the dispatch, a softmax
    over the experts), at the operand whose free dim makes it (the routing mask of the dispatch
    einsum), and where a gradient would lay out a forward value: the routing is outside."""
    links: dict[int, list[tuple[Op, int]]] = {}
    made_in: dict[int, str] = {}  # value -> the phase of the op that makes it
    for op in program.all_ops:
        for i, v in enumerate(op.linked):
            links.setdefault(v, []).append((op, i))
        for v in op.outputs:
            made_in.setdefault(v, op.phase)
    stack = [(e.weight, e.dim) for e in experts] + [a for e in experts for a in e.activations]
    seen: set[tuple[int, int]] = set()
    while stack:
        vid, d = stack.pop()
        if (vid, d) in seen:
            continue
        seen.add((vid, d))
        for op, i in links.get(vid, ()):
            rule = op.rule
            dims = (rule.operands + rule.results)[i]
            if d >= len(dims) or not dims[d]:
                continue
            f = dims[d][0]
            if rule.factors[f].kind != "parallel":
                continue
            holders = [(j, u, ud) for j, (u, udims) in enumerate(zip(op.linked, rule.operands + rule.results,
                                                                    strict=True))
                       for ud, fs in enumerate(udims) if fs and fs[0] == f]
            if traits_of(op.primitive).matmul and not all(
                    any(fs and fs[0] == f for fs in udims) for udims in rule.operands if any(udims)):
                # the factor is a free dim of one operand here: it goes on to the result (an
                # expert output's gradient against the combine), never back into the operand (the
                # routing mask of a dispatch)
                if i >= len(op.linked_inputs) or not free_to_result:
                    continue
                holders = [h for h in holders if h[0] >= len(op.linked_inputs)]
            if op.phase != "forward":  # the gradients never lay out a forward value (the routing's masks)
                holders = [h for h in holders if made_in.get(h[1]) in (None, op.phase) or h[1] == vid]
            stack.extend((u, ud) for _, u, ud in holders)
    return frozenset(v for v, _ in seen)


def experts_of(ctx: PlanContext) -> list[ExpertDim]:
    """:func:`find_experts`, once per program (structure: the same for every state)."""
    key = ("expert_dims", ctx.state_inputs)
    if key not in ctx.program.memo:
        ctx.program.memo[key] = find_experts(ctx.program, ctx.state_inputs)
    return ctx.program.memo[key]


def _context(program: Program, op: Op) -> RuleContext:
    shaped = lambda vids: tuple(Shaped(program.values[v].shape, program.values[v].dtype) for v in vids)  # noqa: E731
    return RuleContext(op.primitive, shaped(op.inputs), shaped(op.outputs), op.source)


def _label(op: Op) -> str:
    return op.name or f"{op.primitive}#{op.id}"


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    axis: str
    tokens: bool = True
    name: str = "expert_parallel"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        program = ctx.program
        tag = f"expert_parallel({self.axis!r})"
        if missing := off_mesh(ctx, state, self.axis, tag):
            return missing
        experts = experts_of(ctx)
        if not experts:
            return TacticResult(state, (f"{tag}: no expert weights (no contraction keeps a weight dim per "
                                        "expert: no dot_general batch dim, no ragged_dot group dim); nothing done",))
        notes: list[str] = []
        reasons: dict[int, str] = {}
        actions: list[Action] = []
        check = state  # each action checked against the ones before it, as apply() applies them
        for e in experts:
            action = Action(e.weight, e.dim, self.axis)
            what = f"{e.kind} dim {e.dim} ({e.size} experts) of {program.values[e.weight].name} at {_label(e.op)}"
            why_not = refusal(check, action, tag, what)
            if why_not:
                notes.append(why_not)
                continue
            check = _taken(check, action)
            actions.append(action)
            reasons[e.weight] = f"{tag}: {e.kind} dim {e.dim}"
            notes.append(f"{tag}: experts over {what}")
            for vid, d in e.activations:  # the expert-major tokens: decided here, not by the batch's layout
                act = Action(vid, d, self.axis)
                if refusal(check, act, tag, "") is None:
                    check = _taken(check, act)
                    actions.append(act)
        if not any(a.value in reasons for a in actions):
            return TacticResult(state, tuple(notes) + (f"{tag}: every expert dim skipped; nothing done",))
        split = self.tokens and bool(self._tokens(ctx, check, [], {}))
        # where the batch stays whole on the axis, the combine mask's gradient stays expert-major
        # (token-major, it would gather the expert outputs); where the batch is split, the expert
        # outputs move to the tokens' layout for the combine anyway, and its gradient reuses that
        key = ("expert_region", ctx.state_inputs, split)
        if key not in program.memo:
            program.memo[key] = expert_region(program, experts, free_to_result=not split)
        # the experts first, fenced in their region: propagation does not carry the expert dim
        # back through the dispatch into the routing (the router, its softmax); the fence is
        # lifted after, so later decisions see an ordinary state
        fence = frozenset(range(len(program.values))) - program.memo[key] - state.frozen
        state = apply(state, actions, freeze=fence, label=tag)
        state = state.replace(frozen=state.frozen - fence)
        if self.tokens:  # then the batch takes the axis everywhere else: the two meet at the dispatch and combine
            tokens = self._tokens(ctx, state, notes, reasons)
            if tokens:
                state = apply(state, tokens, label=f"{tag}: tokens")
        return TacticResult(state, tuple(notes), reasons=reasons)

    def applies(self, ctx: PlanContext, state: ShardingState) -> bool:
        """Whether the program has experts (the search offers the tactic as a macro only then)."""
        return bool(experts_of(ctx))

    def holds(self, ctx: PlanContext, state: ShardingState) -> bool:
        """Whether ``state`` splits some expert weight's expert dim over the axis (this tactic ran)."""
        return any(self.axis in state.spec(e.weight)[e.dim] for e in experts_of(ctx))

    def batch_elsewhere(self, ctx: PlanContext, state: ShardingState) -> bool:
        """Whether ``state`` splits the batch over another axis than this one (data parallelism
        ran there): the tokens-whole layout (``tokens=False``) then is the hand-written one, the
        batch on one axis and the experts on this one, with no all-to-all."""
        return any(a != self.axis for vid, d in self._batch(ctx).items() for a in state.spec(vid)[d])

    def _batch(self, ctx: PlanContext) -> dict[int, int]:
        key = ("batch_dims", ctx.data_inputs, ctx.state_inputs)  # shared with data_parallel
        if key not in ctx.program.memo:
            ctx.program.memo[key] = batch_dims(ctx)
        return ctx.program.memo[key]

    def _tokens(
        self, ctx: PlanContext, state: ShardingState, notes: list[str], reasons: dict[int, str]
    ) -> list[Action]:
        """Split the batch over the axis too (GShard's layout: outside the experts each device of
        the axis holds its own tokens), where it divides."""
        tag = f"expert_parallel({self.axis!r})"
        actions = []
        for vid, d in self._batch(ctx).items():
            action = Action(vid, d, self.axis)
            why_not = refusal(state, action, tag, f"tokens {ctx.program.values[vid].name}")
            if why_not:
                notes.append(why_not + "; the tokens stay whole on the axis outside the experts")
                continue
            actions.append(action)
            reasons.setdefault(vid, f"{tag}: tokens split over the expert axis, batch dim {d}")
        if actions:
            notes.append(f"{tag}: tokens over the expert axis, batch dims "
                         + ", ".join(f"{ctx.program.values[a.value].name}[{a.dim}]" for a in actions))
        return actions


def _taken(state: ShardingState, action: Action) -> ShardingState:
    spec = list(state.spec(action.value))
    spec[action.dim] += (action.axis,)
    return state.replace(specs={**state.specs, action.value: tuple(spec)})


def expert_parallel(axis: str = "model", *, tokens: bool = True) -> ExpertParallel:
    """Expert parallelism on mesh axis ``axis``: the experts of every mixture-of-experts layer
    (found from the contractions, not from names: see the module docstring) are split over it;
    the expert weights' optimizer state and the expert-major activations follow by propagation.

    >>> import jax, jax.numpy as jnp, automap, tactics
    >>> def loss(params, x):  # x: (experts, tokens per expert, features), already dispatched
    ...     h = jnp.tanh(jnp.einsum("etd,edf->etf", x, params["w_in"]))
    ...     return jnp.einsum("etf,efd->etd", h, params["w_out"]).sum()
    >>> def step(params, x):
    ...     value, g = jax.value_and_grad(loss)(params, x)
    ...     return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value
    >>> params = {"w_in": jnp.ones((4, 8, 16)), "w_out": jnp.ones((4, 16, 8))}
    >>> step = automap.partition(step, mesh=automap.make_mesh({"model": 4}), tactics=[expert_parallel("model")])
    >>> plan = step.plan(params, jnp.ones((4, 2, 8)))
    >>> [plan.state.spec(v) for v in plan.program.inputs]  # w_in, w_out and the tokens: experts on 'model'
    [(('model',), (), ()), (('model',), (), ()), (('model',), (), ())]
    >>> plan.notes[0]
    "expert_parallel('model'): experts over batch dim 0 (4 experts) of params/w_in at etd,edf->etf"
    """
    return ExpertParallel(axis, tokens)
