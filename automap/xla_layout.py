"""The layout XLA's propagation (Shardy) gives a program from its input and output specs alone.

A plan that decided only its inputs pins nothing (:func:`automap.emit.pinned_values`), and where
the arbiter keeps the inputs-only program nothing pinned is compiled either: XLA lays out every
intermediate itself, and the estimate is made in that layout (:attr:`automap.api.Plan.layout`),
not in automap's (:mod:`automap.propagate`, where the earliest decision wins). :func:`xla_layout` re-propagates
the plan's input and output specs (fixed, as ``in_shardings``/``out_shardings`` fix them) the way
Shardy's default pipeline does (jax 0.10: op-priority propagation with the aggressive factor
strategy), through automap's factor rules:

- in five rounds (Shardy's op priorities), each to a fixpoint: elementwise-like ops (every
  factor of which every result holds: elementwise ops, transposes, reshapes, broadcasts) whose
  operands have no other use (a program output counts as a use), then every such op, then every op
  along its parallel factors, then every op along every factor; an operand holding fewer factors
  (a broadcast's, or an elementwise operand broadcast along size-1 dims, a ``broadcast_in_dim``
  to XLA) takes axes from the third round on and gives them only in the fifth, the last;
- at an op, each factor takes the axes its linked values agree on (the longest where one's axes
  extend another's; where they disagree, only their common prefix: no decision wins);
- where factors want the same axis on one value, the factor whose proposing value is larger
  takes it (then, at an elementwise op, the factor split more ways; then the earlier value, then
  the earlier factor); a value's size is the product of its Shardy factors' sizes, its element
  count but at a convolution (:mod:`automap.shardy_sizes`: a kernel's window dim counts only where
  the windows leave it room): an activation split on the batch and a larger weight split on
  its output features over one axis give the result the features, and so do a batch split on
  'data' and a same-size feature split on ('data', 'model') at a multiply;
- a mesh axis that a factor has room for only part of is split into sub-axes (Shardy's
  ``"model":(1)2``), the factor taking the part it has room for and the next factor the rest: the
  layout is made on the mesh of the axes' prime sub-axes and given back on the plan's mesh where
  no value holds part of an axis (:mod:`automap.sub_axes`); but a factor minor-most in every dim
  holding it takes an axis that does not divide it whole, its last tile padded (a 70-wide
  concatenation over 'model' of 4 as 4 x 18: :func:`_within_factor`);
- a value is extended, never changed, and fixed values (inputs, outputs) not at all; an operand
  of an elementwise op takes no more axes sideways than its result holds;
- a loop is taken as Shardy's ``while``: its invariant operands are the body's own values, its
  carries data-flow edges taken after the body's ops, not when their init changes
  (:mod:`automap.xla_loops`); a ``split`` passes the split dim's axes on to its pieces (XLA's
  slices do, :func:`~automap.shardy_shape_rules.split_as_shardy`), but as a permutation factor: only in the rounds of
  every factor; so does the joined dim of a ``concatenate``, which automap's rule keeps whole at
  rank one and splits by the pieces' common size at higher ranks
  (:func:`~automap.shardy_shape_rules.concatenate_as_shardy`);
- ops are taken in the order XLA hands them to Shardy (:func:`hlo_order`: the HLO module's
  post-order from its outputs, not the jaxpr's), the ops of a value just extended next, its first
  user first and its producer last (MLIR's greedy rewrite driver, top-down, as Shardy runs it:
  a stack, onto which the producer, then the users, latest first, are pushed).

Checked against Shardy's own passes (jaxlib ships them: ``sdy-op-priority-propagate`` with
``debug-propagation-edge-sharding`` numbers each step): a dot's contracting factor moves before a
broadcast forwards (the fourth round before the fifth), and an elementwise op one of whose
operands has two uses takes part only from the second round. In a transformer's FSDP backward the
order decides whether the cotangent at a LayerNorm keeps the batch split (XLA) or takes d_model
from a parameter gradient's reduction: in jaxpr order the bias gradient's sum came first and gave
d_model (corpus gpt_linen manual_fsdp 1.15x XLA's bytes sent, nnx_transformer 1.11x and 0.92x its
dot FLOPs, the held-out Perceiver 1.33x); in XLA's order the first output's gradient path, with
its batch-split multiplies, comes first.

Every dim gets priority 0: where values still disagree at an op, the cost model
(:func:`automap.analysis.reshards`) resolves the tie as XLA's partitioner does.
"""
from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Sequence

from automap.contraction_layouts import CONTRACTIONS
from automap.factors import Axes, compose_dim, padded_factors, split_dim
from automap.hlo_order import hlo_order
from automap.ir.program import Op, Program
from automap.rules.registry import Factor, FactorRule
from automap.shardings import ShardingState
from automap.shardy_shape_rules import concatenate_as_shardy, split_as_shardy, strided_as_shardy, strided_whole
from automap.shardy_sizes import tensor_size
from automap.sub_axes import coarsened, refined
from automap.xla_loops import LINKED, Link, share_owners, with_loop_links

__all__ = ["xla_layout"]

ROUNDS = ("pass-through ops, operands of one use", "pass-through ops", "parallel factors",
          "all factors, broadcasts backward", "all factors")


def xla_layout(state: ShardingState) -> ShardingState:
    """``state``'s program laid out from the specs of its inputs and outputs alone, as XLA's
    propagation lays it out (module docstring); every other spec of ``state`` is dropped.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((8, 16)), jnp.ones((16, 64))),
    ...              ["x", "w"], ["y"])
    >>> x, w = prog.inputs
    >>> s = ShardingState(prog, {"data": 2}, specs={x: (("data",), ()), w: ((), ("data",))})
    >>> xla_layout(s).spec(prog.ops[0].outputs[0])  # the larger weight's feature split wins over the batch
    ((), ('data',))
    """
    program = state.program
    fixed = frozenset(program.inputs) | frozenset(program.outputs)
    sizes, specs = refined(state, {v: state.specs[v] for v in fixed if v in state.specs})
    order, neighbours, facts = _static(program)
    budget = 64 * (len(order) + 1)
    for level in range(len(ROUNDS)):
        queue = [op for op in reversed(order) if facts[op.id].takes_part[level]]  # popped in XLA's order
        queued = set(queue)
        while queue and budget:
            budget -= 1
            op = queue.pop()
            queued.discard(op)
            for vid in _take(op, level, facts[op.id], specs, fixed, sizes):
                for other in neighbours[vid]:
                    if other is not op and other not in queued and facts[other.id].takes_part[level]:
                        queued.add(other)
                        queue.append(other)
    sizes, specs = coarsened(state, specs) or (sizes, specs)
    priority = {(v, d): 0 for v, spec in specs.items() for d, axes in enumerate(spec) if axes}
    return ShardingState(program, dict(sizes), specs=specs, priority=priority, frozen=state.frozen | fixed,
                         next_priority=max(state.next_priority, 1), labels=dict(state.labels))


class _Facts(NamedTuple):
    """What :func:`_step` reads of an op that no state changes (computed once per program)."""

    taken: Op | Link  # the op as Shardy propagates it (a split as its slices: :func:`~automap.shardy_shape_rules.split_as_shardy`)
    elementwise: bool  # _pass_through
    every: set[int]  # the factors of more than one element
    holds: list[set[int]]  # per linked value, the factors its dims hold
    sized: list[set[int]]  # per linked value, those of more than one element
    directions: tuple[tuple[str, ...], ...]  # per round, per factor: _direction
    takes_part: tuple[bool, ...]  # per round: whether the op is queued (its own rule's directions)
    spread: bool  # _same_dims
    tensor_sizes: list[int]  # per linked value, its size as Shardy takes it (automap.shardy_sizes)
    padded: frozenset[int]  # the factors Shardy splits padded: _within_factor


def _static(program: Program) -> tuple[list, list[list], dict[int, _Facts]]:
    """The ops in the order Shardy takes them (loops as their ties and edges:
    :func:`automap.xla_loops.with_loop_links`), each value's neighbours in the order Shardy's
    driver visits them (a changed value's producer, then its users, latest first: the first user
    is popped first) and each op's :class:`_Facts`: what :func:`xla_layout` derives from the
    program alone, memoised on it."""

    def compute():
        order = with_loop_links(program, hlo_order(program))
        position = {op.id: i for i, op in enumerate(order)}
        users_of = [[o for o in ops if o.primitive not in LINKED] for ops in program.users_of]
        for link in order:
            if isinstance(link, Link):
                for vid in link.owners:
                    users_of[vid].append(link)
        neighbours = [[o for o in ops if vid in o.linked_outputs]
                      + sorted((o for o in ops if vid not in o.linked_outputs), key=lambda o: -position[o.id])
                      for vid, ops in enumerate(users_of)]
        single = _single_use(program) | {op.id: True for op in order if isinstance(op, Link)}
        return order, neighbours, {op.id: _facts_of(op, single[op.id], program) for op in order}

    return program.memo_of(program.ops, ("xla_layout.static",), compute)


def _facts_of(op: Op | Link, single: bool, program: Program) -> _Facts:
    def directions(op: Op | Link) -> tuple[tuple[str, ...], ...]:
        rule = op.rule
        elementwise = _pass_through(op.primitive, rule, rule.operands + rule.results)
        return tuple(tuple(_direction(op, level, f, single, elementwise) for f in range(len(rule.factors)))
                     for level in range(len(ROUNDS)))

    strided = op.primitive in ("slice", "pad")
    taken = (split_as_shardy(op) if op.primitive == "split" else strided_as_shardy(op) if strided
             else concatenate_as_shardy(op, program))
    rule = taken.rule
    dims_of = rule.operands + rule.results
    holds = [{f for dim in dims for f in dim} for dims in dims_of]
    # a split is queued by its own rule, a strided slice or pad by its rule with the dim whole
    queued_as = op if op.primitive == "split" else strided_whole(op) if strided else taken
    own = directions(queued_as)
    return _Facts(taken, _pass_through(taken.primitive, rule, dims_of), _sized(rule, range(len(rule.factors))), holds,
                  [_sized(rule, h) for h in holds], own if taken is op else directions(taken),
                  tuple(bool(queued_as.rule.factors) and any(d) for d in own), _same_dims(dims_of, len(rule.operands)),
                  [tensor_size(taken, t, program.values) for t in range(len(taken.linked))],
                  padded_factors(rule, permutation=True))


def _take(op, level: int, facts: _Facts, specs: dict, fixed: frozenset, sizes: Mapping[str, int]) -> list[int]:
    """:func:`_step`; at a loop's edge its owners (the body inputs, the result) hold one layout:
    the one that extends the others, before and after the step."""
    if op.primitive != "loop_edge":
        return _step(facts.taken, level, facts, specs, fixed, sizes)
    owners = op.linked_outputs
    changed = share_owners(owners, specs, fixed)
    changed += _step(op, level, facts, specs, fixed, sizes)
    changed += share_owners(owners, specs, fixed)
    return list(dict.fromkeys(changed))


def _pass_through(primitive: str, rule: FactorRule, dims_of: Sequence) -> bool:
    """An elementwise-like op: no reduction or blocked factor, every factor in every result (an
    operand holding fewer is broadcast along size-1 dims, or by a ``broadcast_in_dim``); never a
    contraction, though one that sums nothing has such a rule (``bth,bte->bthe``): Shardy takes a
    ``dot_general`` with the other ops, from the round of parallel factors, and both its operands
    propose there (as pass-through ops with fewer factors, an outer product's two operands proposed
    nothing before the last round: its batch split came after the dot of its result with a weight
    had taken the weight's feature split; the held-out router's expert MLP under FSDP specs
    then computed its backward on the features where XLA ran it on the batch, 0.67x XLA's bytes sent)."""
    if primitive in CONTRACTIONS or any(f.kind != "parallel" for f in rule.factors):
        return False
    every = _sized(rule, range(len(rule.factors)))
    n = len(rule.operands)
    return all(_sized(rule, (f for dim in dims for f in dim)) == every for dims in dims_of[n:] if dims)


def _sized(rule: FactorRule, factors) -> set[int]:
    """The factors of more than one element (a broadcast adding only size-1 dims is a reshape)."""
    return {f for f in factors if rule.factors[f].size > 1}


def _single_use(program: Program) -> dict[int, bool]:
    """op id -> whether each operand the op reads whole (not a scalar, not broadcast along size-1
    dims: XLA broadcasts those afresh for each use) has only this one use (a program output counts
    as a use; ``x * x`` and ``integer_pow`` use ``x`` twice)."""
    uses = dict.fromkeys(range(len(program.values)), 0)
    for op in program.all_ops:
        for v in op.inputs:
            uses[v] += 2 if op.primitive in SQUARING else 1
    for v in program.outputs:
        uses[v] += 1
    out = {}
    for op in program.all_ops:
        rule = op.rule
        every = _sized(rule, range(len(rule.factors)))
        whole = [v for v, dims in zip(op.linked_inputs, rule.operands)
                 if program.values[v].shape and _sized(rule, (f for dim in dims for f in dim)) == every]
        out[op.id] = all(uses[v] == 1 for v in whole)
    return out


SQUARING = ("integer_pow", "square")


FORWARD_ONLY = ("dynamic_slice", "dynamic_update_slice")


def _direction(op: Op, level: int, f: int, single: bool, elementwise: bool) -> str:
    """How round ``level`` propagates factor ``f`` through ``op``: "both" ways, "forward" (from
    the operands), "backward" (from the results) or "" (not at all); each round also does what
    the rounds before it did, but the first, which only takes ops whose operands have one use
    (``single``)."""
    rule = op.rule
    kind = rule.factors[f].kind
    if kind == "blocked" or (level == 0 and not single):
        return ""
    if elementwise:  # _pass_through
        return "both"
    first = "forward" if op.primitive in FORWARD_ONLY else ""
    if level <= 1 or (level == 2 and kind != "parallel"):
        return first
    return "both"


def _common(old: Axes, new: Axes, can_expand: bool) -> tuple[Axes, bool]:
    """The axes two values agree on along a factor: their common prefix, extended by the longer
    one's rest where they do not conflict (and ``can_expand``)."""
    n = 0
    while n < len(old) and n < len(new):
        if old[n] != new[n]:
            return old[:n], False
        n += 1
    return (old + new[n:] if can_expand else old), can_expand


def _step(op: Op | Link, level: int, facts: _Facts, specs: dict, fixed: frozenset,
          sizes: Mapping[str, int]) -> list[int]:
    """Propagate through one op (module docstring); returns the values whose spec grew."""
    rule = op.rule
    linked = op.linked
    dims_of = rule.operands + rule.results
    n_operands = len(rule.operands)
    holds = facts.holds
    cur: list[dict[int, Axes]] = []
    found = False
    for vid, dims in zip(linked, dims_of, strict=True):
        spec = specs.get(vid)
        fax: dict[int, Axes] = {}
        if spec is not None:
            found = True
            for d, fs in enumerate(dims):
                if spec[d] and fs:
                    fax.update(split_dim(spec[d], fs, rule, sizes, facts.padded))
        cur.append(fax)
    if not found:  # nothing to propagate
        return []
    elementwise = facts.elementwise
    every = facts.every
    # an elementwise op's operand broadcast along size-1 dims is an implicit broadcast_in_dim: it
    # proposes nothing before the last round, and takes axes (backward) from the third on
    broadcast = {t for t in range(n_operands) if elementwise and facts.sized[t] != every} if level < 4 else set()
    wanted: dict[int, Axes] = {}
    operands, results = list(range(n_operands)), list(range(n_operands, len(linked)))
    for f, direction in enumerate(facts.directions[level]):
        if not direction:
            continue
        first, then = (results, operands) if direction == "backward" else (operands, results)
        axes: Axes = ()
        can_expand = True
        for t in first:
            if f in holds[t] and t not in broadcast:
                axes, can_expand = _common(axes, cur[t].get(f, ()), can_expand)
        can_expand = can_expand and direction == "both"
        for t in then:
            if f in holds[t] and t not in broadcast:
                axes, can_expand = _common(axes, cur[t].get(f, ()), can_expand)
        if axes:
            wanted[f] = axes
    if not wanted:
        return []
    # factors in order of preference: the larger source value, then the earlier one, then the factor
    source: dict[int, tuple[int, int]] = {}
    for t in range(len(dims_of)):
        size = facts.tensor_sizes[t]  # the product of its factors' sizes (a conv's differs)
        for f in holds[t] & wanted.keys():
            got = cur[t].get(f, ())
            if got[: len(wanted[f])] == wanted[f] and len(got) >= len(wanted[f]) and size > source.get(f, (-1, 0))[0]:
                source[f] = (size, t)
    # at an elementwise op, a tie in size goes to the factor split more ways (Shardy's aggressive strategy)
    spread = facts.spread
    order = sorted(wanted, key=lambda f: (-source.get(f, (-1, 0))[0],
                                          -math.prod(sizes[a] for a in wanted[f]) if spread else 0,
                                          source.get(f, (-1, 0))[1], f))
    changed = []
    for t in list(range(n_operands, len(linked))) + list(range(n_operands)):
        vid = linked[t]
        if vid in fixed or not dims_of[t] or (t in broadcast and level <= 1):
            continue
        fax = dict(cur[t])
        old_spec = specs.get(vid) or tuple(() for _ in dims_of[t])
        held_axes = {a for axes in old_spec for a in axes}  # dims without a factor here hold axes too
        grown = False
        for f in order:
            if f not in holds[t]:
                continue
            new = _within_factor(wanted[f], rule.factors[f].size, sizes, f in facts.padded)
            have = fax.get(f, ())
            if len(new) <= len(have) or new[: len(have)] != have:
                continue
            taken = (held_axes - set(have)) | {a for g, ax in fax.items() if g != f for a in ax}
            keep = have
            for a in new[len(have):]:
                if a in taken:
                    break
                keep += (a,)
            if t < n_operands and elementwise:  # no sideways growth past what a result holds
                for r in range(n_operands, len(linked)):
                    held = cur[r].get(f, ())
                    if len(held) < len(keep) and keep[: len(held)] == held:
                        keep = held
            if len(keep) > len(have):
                fax[f] = keep
                grown = True
        if grown:
            spec = tuple(_extend(old, compose_dim(fs, fax, rule, sizes)) if fs else old
                         for fs, old in zip(dims_of[t], old_spec))
            used = [a for axes in spec for a in axes]
            if spec != specs.get(vid) and used and len(used) == len(set(used)):
                specs[vid] = spec
                cur[t] = fax
                changed.append((t, vid))
    return [vid for _, vid in sorted(changed)]  # as Shardy updates them: operands, then results


def _same_dims(dims_of: Sequence, n_operands: int) -> bool:
    """Elementwise in Shardy's sense: every operand maps its dims to the result's factors one to
    one, in order (not a transpose, reshape or broadcast)."""
    results = [dims for dims in dims_of[n_operands:] if dims]
    return bool(results) and all(dims == results[0] for dims in dims_of if dims)


def _extend(old: Axes, new: Axes) -> Axes:
    """``new`` where it extends ``old``, else ``old`` (a spec only grows)."""
    return new if new[: len(old)] == old else old


def _within_factor(axes: Axes, size: int, sizes: Mapping[str, int], padded: bool = False) -> Axes:
    """The prefix of ``axes`` a factor of ``size`` can take: block tiles (each axis divides what
    the ones before leave), or, ``padded`` (:func:`automap.factors.padded_factors`: minor-most in
    every dim holding it), every axis, the last tile padded, as Shardy takes them
    (``compatiblePrefixNoConflictsWithinFactor``)."""
    if padded and size > 1:
        return axes
    kept: Axes = ()
    for a in axes:
        if size % (math.prod(sizes[b] for b in kept) * sizes[a]):
            break
        kept += (a,)
    return kept
