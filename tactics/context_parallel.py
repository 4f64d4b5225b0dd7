"""``context_parallel(axis)``: the whole layer split on the sequence dim, keys and values gathered.

Sequence parallelism (:mod:`tactics.sequence_parallel`) splits only the regions between
tensor-parallel ones. Context parallelism splits everything on the sequence dim over ``axis``:
the token inputs, the embeddings, the layer norms, the MLP, the queries, the attention scores
and the attention output. Attention is the one place where positions meet: at the scores
``q . k`` each query needs every key, so the keys (and at ``scores . v`` the values) are
all-gathered over the axis, the scores ``[..., q, ..., k]`` are split on ``q`` with ``k`` whole,
and the softmax over ``k`` runs locally; in the backward pass the gradients of the keys and
values are partial sums over the axis, reduce-scattered back to the sequence split. This is the
all-gather form of context parallelism (Llama 3's training); ring attention sends the same bytes
pipelined. The weights are whole on the axis and their gradients all-reduced over it, as under
data parallelism; a causal mask or a rotary position table is computed from positions (an
``iota``), which are split on ``q`` with the scores.

The structure is found, not named. A *sequence* dim is a non-batch dim of a data input (see
:func:`tactics.sequence_parallel.token_dims`). An *attention* is a contraction of two activations
(no weight) whose result holds the sequence dim twice, once from each operand (the scores), and
whose *key* dim, followed forward, is contracted with another activation (``scores . v``, the
*mix*) whose result carries the scores' other, *query* dim. The decision tiles the data inputs'
sequence dims, the scores' and the mix's query dims on the axis, so propagation cannot split the
scores on the key and gather the queries instead (left to operand order, it would at the mix:
``jnp.einsum`` puts ``v`` first). The weights (and what is computed from them alone, the position
embeddings), the other inputs and the outputs are fenced while the decision propagates and the
fence is lifted after it.

Attention allows it when every place the sequence dim is contracted is the key dim of a mix:
a sequence dim contracted with a weight (token mixing), with an activation in another way
(linear attention's ``k^T v``), or blocked (a reshape merging it) would need another scheme, and
the tactic refuses, naming the op.

What it costs and saves (zoo GPT, 1 layer, d_model 32, batch 4, mesh data=2 x model=4, XLA:CPU, per
device; ``python tests/tactics/test_context_parallel.py``): the weights' gradients are all-reduced over
the sequence axis too, so at sequence 16 dp+context_parallel sends 181 KiB against data parallel's 68
and dp+megatron's 56; at sequence 128 the activations dominate, and it holds 943 KiB against 2,564
(dp) and 1,058 (dp+megatron) while sending 289 KiB against megatron's 326. The estimate's bytes are
XLA's to the byte on the GPT and the corpus Llama, at sequence 16 and 128, after the cost model
learnt two things XLA does: it all-reduces each sharded reduction factor on its own (a weight's
gradient, partial over the batch on 'data' and the sequence on 'model', is all-reduced over 'model'
and then over 'data'), and a contraction whose result is wanted whole (the Llama's values, made by
a projection) gathers its operand rather than its result.
"""
from __future__ import annotations

import dataclasses

from automap.ir.program import Op, Program
from automap.propagate import apply
from automap.shardings import Action, ShardingState
from tactics.base import PlanContext, TacticResult, off_mesh, refusal
from tactics.flow import Flow, consumers, follow, weight_derived
from tactics.sequence_parallel import token_dims


@dataclasses.dataclass(frozen=True)
class Attention:
    """One attention found in the program: the scores contraction and the mix that contracts its key."""

    scores: Op  # q . k: both operands carry the sequence dim, the result holds both
    query: int  # dim of the scores (the result of ``scores``) that is the query's sequence
    key: int  # dim of the scores that is the key's sequence (contracted at ``mix``)
    mix: Op  # scores . v, contracting the key dim
    probs: tuple[int, int]  # (the mix's operand computed from the scores, its query dim)
    out_query: int  # dim of the mix's result that is the query's sequence
    keys: int  # the scores' operand that carries the key dim
    values: int  # the mix's other operand

    @property
    def gathered(self) -> tuple[int, int]:
        """The values whole on the axis: the keys and the values."""
        return self.keys, self.values


@dataclasses.dataclass(frozen=True)
class Layout:
    """What :func:`find_attention` finds: the sequence dims of the data inputs and the attentions,
    or why context parallelism does not apply (``why_not`` non-empty)."""

    inputs: tuple[tuple[int, int], ...]  # (data input, its sequence dim)
    attentions: tuple[Attention, ...]
    why_not: tuple[str, ...]


def _sequence_pair(program: Program, op: Op, tokens: frozenset, on_batch: frozenset) -> tuple[int, int] | None:
    """The two result dims of a contraction of activations that hold the sequence dim, one from
    each operand (the scores), or None."""
    rule, out = op.rule, op.linked_outputs[0]
    dims = [d for d, fs in enumerate(rule.results[0])
            if fs and (out, d) in tokens and (out, d) not in on_batch and program.values[out].shape[d] > 1]
    if len(dims) != 2:
        return None
    owners = []
    for d in dims:
        f = rule.results[0][d][0]
        owners.append({i for i, operand in enumerate(rule.operands) if any(f in fs for fs in operand)})
    if owners != [{0}, {1}] and owners != [{1}, {0}]:
        return None
    return dims[0], dims[1]


def _attention(program: Program, op: Op, pair: tuple[int, int], weights: set[int], users) -> Attention | None:
    """The attention whose scores ``op`` makes, with its key one of ``pair``: the dim contracted
    with an activation at an op whose result carries the other dim."""
    out = op.linked_outputs[0]
    flows = [follow(program, out, d, weights, users=users) for d in pair]
    for key, (k_flow, q_flow) in enumerate(((flows[0], flows[1]), (flows[1], flows[0]))):
        mixes = [m for m in k_flow.ops("contract_activation")
                 if any((m.linked_outputs[0], d) in q_flow.visited for d in range(program.values[m.linked_outputs[0]].ndim))]
        if len(mixes) != 1:
            continue
        mix = mixes[0]
        result = mix.linked_outputs[0]
        probs = next(((v, d) for v in mix.linked_inputs for d in range(program.values[v].ndim)
                      if (v, d) in q_flow.visited), None)
        if probs is None:
            continue
        out_query = next(d for d in range(program.values[result].ndim) if (result, d) in q_flow.visited)
        k_factor = op.rule.results[0][pair[key]][0]
        keys = next(v for v, dims in zip(op.linked_inputs, op.rule.operands, strict=True)
                    if any(k_factor in fs for fs in dims))
        values = next((v for v in mix.linked_inputs if v != probs[0]), None)
        if values is None:
            continue
        return Attention(op, pair[1 - key], pair[key], mix, probs, out_query, keys, values)
    return None


def find_attention(program: Program, ctx: PlanContext) -> Layout:
    """The sequence dims of the data inputs and every attention, or why context parallelism
    does not apply (structure only: the same for every sharding state)."""
    weights = weight_derived(program, ctx.state_inputs)
    users = consumers(program)
    on_batch, tokens = token_dims(program, ctx)
    attentions: list[Attention] = []
    why_not: list[str] = []
    for op in program.all_ops:
        if op.phase != "forward" or op.primitive != "dot_general" or any(v in weights for v in op.linked_inputs):
            continue
        pair = _sequence_pair(program, op, tokens, on_batch)
        if pair is None:
            continue
        found = _attention(program, op, pair, weights, users)
        if found is None:
            why_not.append(f"{_where(op)} holds the sequence dim twice but neither is contracted with the values")
        else:
            attentions.append(found)
    if not attentions and not why_not:
        why_not.append("no attention (no contraction of two activations holds the sequence dim twice)")
    scores = {(a.scores.linked_outputs[0], d) for a in attentions for d in (a.query, a.key)}
    flows: dict[tuple[int, int], Flow] = {
        (vid, d): follow(program, vid, d, weights, users=users)
        for vid in ctx.data_inputs for d in range(program.values[vid].ndim)
        if (vid, d) not in on_batch and program.values[vid].shape[d] > 1
    }
    reaching = {k for k, f in flows.items() if f.visited & scores}
    sequence = set().union(*(flows[k].visited for k in reaching)) if reaching else set()
    inputs = [k for k, f in flows.items() if k in reaching or f.visited & sequence]  # targets meet the logits
    mixes = {a.mix for a in attentions}
    for k in inputs:
        flow = flows[k]
        for end in flow.ends:
            if end.kind in ("contract_activation", "contract_weight", "blocked") and end.op not in mixes:
                what = {"contract_activation": "contracted with an activation", "blocked": "blocked",
                        "contract_weight": "contracted with a weight"}[end.kind]
                why_not.append(f"the sequence dim of {program.values[k[0]].name} is {what} at {_where(end.op)}")
    if not inputs:
        why_not.append("no data input has a sequence dim reaching the attention scores")
    return Layout(tuple(inputs), tuple(attentions), tuple(dict.fromkeys(why_not)))


def _where(op: Op) -> str:
    return f"{op.primitive} {op.name or '?'} ({op.source})"


def attention_layout(ctx: PlanContext) -> Layout:
    """:func:`find_attention`, once per program."""
    memo, key = ctx.program.memo, ("context_parallel", ctx.data_inputs, ctx.state_inputs)
    got = memo.get(key)
    if got is None:
        got = memo[key] = find_attention(ctx.program, ctx)
    return got


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """The tactic :func:`context_parallel` makes."""

    axis: str
    name: str = "context_parallel"

    def __call__(self, ctx: PlanContext, state: ShardingState) -> TacticResult:
        program, tag = ctx.program, f"context_parallel({self.axis!r})"
        if missing := off_mesh(ctx, state, self.axis, tag):
            return missing
        layout = attention_layout(ctx)
        if layout.why_not:
            reason = "; ".join(layout.why_not[:3])
            return TacticResult(state, (f"{tag}: attention does not allow it ({reason}); nothing done",))
        wanted: list[tuple[Action, str]] = [(Action(v, d, self.axis), f"{program.values[v].name}: sequence dim {d}")
                                            for v, d in layout.inputs]
        for a in layout.attentions:
            what = f"{a.scores.name or 'attention'}"
            wanted += [(Action(a.scores.linked_outputs[0], a.query, self.axis), f"{what} scores: query dim {a.query}"),
                       (Action(a.probs[0], a.probs[1], self.axis), f"{what} probabilities: query dim {a.probs[1]}"),
                       (Action(a.mix.linked_outputs[0], a.out_query, self.axis), f"{what} output: query dim {a.out_query}")]
        notes, actions, reasons = [], [], {}
        for action, what in wanted:
            skip = refusal(state, action, tag, what)
            if skip:
                # a refused sequence dim or query dim would leave the attention half decided
                return TacticResult(state, (skip, f"{tag}: nothing done"))
            if action not in actions:
                actions.append(action)
                reasons.setdefault(action.value, f"{tag}: {what.split(': ', 1)[1]}")
        notes.append(f"{tag}: sequence dims of {len(layout.inputs)} data inputs and the query dims of "
                     f"{len(layout.attentions)} attentions; keys and values gathered")
        fence = _fence(program, ctx, layout, {a.value for a in actions}) - state.frozen
        state = apply(state, actions, freeze=fence, label=tag)
        state = state.replace(frozen=state.frozen - fence)
        return TacticResult(state, tuple(notes), reasons=reasons)


def _fence(program: Program, ctx: PlanContext, layout: Layout, acted: set[int]) -> frozenset[int]:
    """What the decision leaves alone: the keys and values (whole on the axis: gathered where
    they are made), the state inputs, the inputs not acted on and the outputs."""
    held = set(ctx.state_inputs) | set(program.inputs) | set(program.outputs)
    held.update(v for a in layout.attentions for v in a.gathered)
    return frozenset(held - acted)


def context_parallel(axis: str = "model") -> ContextParallel:
    """Context parallelism on mesh axis ``axis``: every activation split on its sequence dim,
    the attention scores split on the query with the keys and values all-gathered (see the
    module docstring); refuses, with the reason in the plan's notes, where a sequence dim is
    contracted otherwise. Composes with ``data_parallel`` and ``megatron`` on other axes; put it
    after ``megatron``: a later decision that splits the keys' producer again (megatron's heads)
    carries the sequence split into the keys, and the gather moves to the scores.

    >>> import jax, jax.numpy as jnp, automap, tactics
    >>> def loss(w, x):  # x: (batch, seq, features); one attention head
    ...     q, k, v = x @ w[0], x @ w[1], x @ w[2]
    ...     p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k), axis=-1)
    ...     return jnp.einsum("bqk,bkd->bqd", p, v).sum()
    >>> def step(w, x):
    ...     value, g = jax.value_and_grad(loss)(w, x)
    ...     return w - 0.1 * g, value
    >>> cp = tactics.schedule(tactics.data_parallel("data"), context_parallel("model"))
    >>> step = automap.partition(step, mesh=automap.make_mesh({"data": 2, "model": 2}), tactics=[cp], search=None)
    >>> plan = step.plan(jnp.ones((3, 4, 4)), jnp.ones((2, 8, 4)))
    >>> plan.state.spec(plan.program.inputs[1])  # x: batch on 'data', sequence on 'model'
    (('data',), ('model',), ())
    >>> scores = [op for op in plan.program.all_ops if op.primitive == "dot_general"][3]
    >>> plan.state.spec(scores.outputs[0])  # split on the query, every key
    (('data',), ('model',), ())
    >>> sorted({c.kind for c in plan.estimate.collectives if c.axes == ("model",)})
    ['all-gather', 'all-reduce', 'reduce-scatter']
    """
    return ContextParallel(axis)
