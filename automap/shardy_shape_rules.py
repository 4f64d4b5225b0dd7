"""The factor rules Shardy gives ``split``, ``concatenate`` and strided ``slice``/``pad`` where
they differ from automap's own (:mod:`automap.rules.shape`), used to predict the layout XLA compiles
(:mod:`automap.xla_layout`): a split as its slices, sharing a permutation factor with its
operand; a rank-one concatenate keeping its joined dim's split; a concatenate of rank two or more
with its joined dim one factor of the result's size, which a mesh axis may split padded; a
strided slice (an interior pad) with its strided dim one permutation factor.
"""
from __future__ import annotations

import math

from automap.ir.program import Op, Program
from automap.rules.registry import Factor, FactorRule
from automap.xla_loops import Link

__all__ = ["concatenate_as_shardy", "split_as_shardy", "strided_as_shardy", "strided_whole"]


def split_as_shardy(op: Op) -> Link:
    """A ``split`` as Shardy propagates it: XLA hands it one ``slice`` per piece, whose rule
    shares every dim with its operand, the sliced one too (``([i, j])->([i, j]) permutation={j}``):
    a split dim passes its axes on, and the partitioner moves the pieces by collective-permutes.
    automap's rule keeps the dim whole (for the layouts it pins, :func:`automap.rules.shape._split`);
    the estimate prices the layout with it, and the pieces' permutes as :mod:`automap.split_moves`
    does. Held-out flax LSTM (its gates split from one (8, 128)
    dot inside the scan), FSDP specs, inputs-only, mesh 2x4: XLA splits the gates' features on
    'model' as the weights' are; kept whole, the model replicated them (1.40x XLA's memory, 1.22x
    its dot FLOPs under ``fsdp_tp``).

    The sliced dim is a permutation factor of the operand's size (Shardy's rule marks it so; a
    minor-most factor, it takes an axis that does not divide it, padded): it moves in the rounds of
    every factor, after the parallel ones (a dot's batch) have, and a piece that has taken another
    factor on the same axes from a user by then keeps it (Shardy's ``debug-propagation-edge-sharding``
    on XLA's dump: a (8, 96) gate split (8, 32)-wise, its features on ('data', 'model'), times a
    dot's batch-split result: the product and the piece take the batch, the slice moves nothing).
    Passed on with the parallel factors, the held-out eqx GRU's pieces took the features first and
    its carry followed them (``manual_fsdp`` 0.46x XLA's bytes sent, 0.40x its memory).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda g: jnp.split(g, 3, axis=1))(jnp.ones((8, 48))), ["g"], list("abc"))
    >>> rule = split_as_shardy(prog.ops[0]).rule  # the sliced dim: one permutation factor of 48
    >>> rule.factors[-1].size, rule.factors[-1].kind, rule.results[0][1]
    (48, 'permutation', (1,))
    """
    rule = op.rule
    axis = op.params["axis"] % len(rule.operands[0])
    shared = len(rule.factors)
    dims = lambda all_dims: tuple(tuple((shared,) if d == axis else fs for d, fs in enumerate(v))  # noqa: E731
                                  for v in all_dims)
    rule = FactorRule(rule.factors + (Factor(sum(map(int, op.params["sizes"])), "permutation"),), dims(rule.operands),
                      dims(rule.results))
    return Link(op.id, "split", rule, op.linked_inputs, op.linked_outputs, frozenset(), False)


def strided_whole(op: Op) -> Op | Link:
    """A strided ``slice`` or interior ``pad`` whose rule splits the strided dim
    (:func:`automap.rules.shape._strided`: its kept digit shared, its offset a blocked digit) with
    that dim whole, as automap's rule had it before: the rule by which :mod:`automap.xla_layout`
    queues the op (its other dims pass through, as a split's are queued: :func:`split_as_shardy`).
    Any other op is returned as it is.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> op = lower(jax.make_jaxpr(lambda x: x[:, ::2])(jnp.ones((4, 16))), ["x"], ["y"]).ops[0]
    >>> op.rule.operands[0], strided_whole(op).rule.operands[0], strided_whole(op).rule.results[0]
    (((0,), (1, 2)), ((0,), ()), ((0,), ()))
    """
    rule = op.rule
    blocked = [f for f, factor in enumerate(rule.factors) if factor.kind == "blocked"]
    if op.primitive not in ("slice", "pad") or not blocked:
        return op
    first = min(blocked) - 1  # _strided appends (kept, offset) pairs after _along's factors
    dims = lambda all_dims: tuple(tuple(() if any(f >= first for f in fs) else fs for fs in v)  # noqa: E731
                                  for v in all_dims)
    return Link(op.id, op.primitive, FactorRule(rule.factors[:first], dims(rule.operands), dims(rule.results)),
                op.linked_inputs, op.linked_outputs, frozenset(), False)


def strided_as_shardy(op: Op) -> Op | Link:
    """A strided ``slice`` or interior ``pad`` (:func:`strided_whole`) as Shardy propagates it:
    the strided dim one permutation factor of the wider side's size, shared by both sides (the
    rule Shardy gives every slice: ``addPointwiseWithDiffTypeForMismatch``), so it moves only in
    the rounds of every factor, as a split's does (:func:`split_as_shardy`). Propagated with
    the parallel factors (automap's rule), the held-out keras-hub GPT-OSS's gate/up halves
    (``gate_up[..., ::2]``) took the features on ('data', 'model') where XLA splits the tokens
    (``manual_fsdp`` 0.62x XLA's bytes sent, 1.00x so); kept whole, a strided slice's gradient
    (its interior pad) was gathered where XLA runs it split (estimate 128 KiB sent, XLA none).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> op = lower(jax.make_jaxpr(lambda x: x[:, ::2])(jnp.ones((4, 16))), ["x"], ["y"]).ops[0]
    >>> rule = strided_as_shardy(op).rule
    >>> rule.operands[0], rule.results[0], rule.factors[-1]
    (((0,), (1,)), ((0,), (1,)), Factor(size=16, kind='permutation'))
    """
    whole = strided_whole(op)
    if whole is op:
        return op
    factors, operands, results = list(whole.rule.factors), list(whole.rule.operands[0]), list(whole.rule.results[0])
    for d, (split, kept) in enumerate(zip(op.rule.operands[0], whole.rule.operands[0], strict=True)):
        if split != kept:
            wider = max(math.prod(op.rule.factors[f].size for f in dims[d]) for dims in (op.rule.operands[0],
                                                                                          op.rule.results[0]))
            factors.append(Factor(wider, "permutation"))
            operands[d] = results[d] = (len(factors) - 1,)
    rule = FactorRule(tuple(factors), (tuple(operands),) + whole.rule.operands[1:], (tuple(results),))
    return Link(op.id, op.primitive, rule, op.linked_inputs, op.linked_outputs, frozenset(), False)


def _vector_concatenate(op: Op | Link, program: Program) -> Op | Link:
    """A ``concatenate`` of rank one as Shardy propagates it: the joined dim a permutation factor
    (the pieces' common size) as at any rank; automap's rule keeps it whole (XLA gathers the pieces,
    :func:`automap.rules.shape._concatenate`), and the estimate prices the layout with it: the
    sharded pieces gathered, the result sliced where it lives. Held-out jraph GCN (its senders,
    split on ('data', 'model'), joined with an ``arange`` of self-edges): XLA splits the indices
    the lookup and ``segment_sum`` use, gathers the node table and reduce-scatters the sum; kept
    whole, the estimate looked up masked and all-reduced the (320, 32) result (``manual_dp`` 1.22x
    XLA's bytes sent). Any other op is returned as it is."""
    if op.primitive != "concatenate" or len(op.rule.operands[0]) != 1 or isinstance(op, Link):
        return op
    sizes = [program.values[v].shape[0] for v in op.linked]
    factor = ((len(op.rule.factors),),)
    rule = FactorRule(op.rule.factors + (Factor(math.gcd(*sizes), "permutation"),), tuple(factor for _ in op.rule.operands),
                      tuple(factor for _ in op.rule.results))
    return Link(op.id, op.primitive, rule, op.linked_inputs, op.linked_outputs, frozenset(), False)


def concatenate_as_shardy(op: Op | Link, program: Program) -> Op | Link:
    """A ``concatenate`` as Shardy propagates it (of rank one:
    :func:`_vector_concatenate`); of rank two or more, the joined dim one
    permutation factor of the result's size, which every operand's dim holds, so that a mesh axis
    not dividing the pieces' common size still splits the result, padded (:func:`automap.xla_layout._within_factor`).
    automap's rule splits the joined dim by the pieces' common size only
    (:func:`automap.rules.shape._concatenate`). A (256, 70) joined from pieces of 4, 32 and 34
    columns, the 32 split on 'model' (4): XLA splits the 70 into 4 x 18, padded; by the common size
    (2), the model split it in two. Any other op is returned as it is.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda a, b: jnp.concatenate([a, b], 1))(jnp.ones((8, 6)), jnp.ones((8, 32))),
    ...              ["a", "b"], ["c"])
    >>> concatenate_as_shardy(prog.ops[0], prog).rule.factors[-1].size  # the result's 38 columns, not gcd(6, 32)
    38
    """
    if op.primitive != "concatenate" or isinstance(op, Link) or len(op.rule.operands[0]) == 1:
        return _vector_concatenate(op, program)
    axis = op.params["dimension"]
    joined = len(op.rule.factors)
    rule = op.rule

    def dims(value_dims):
        return tuple((joined,) if d == axis else fs for d, fs in enumerate(value_dims))

    size = program.values[op.outputs[0]].shape[axis]
    rule = FactorRule(rule.factors + (Factor(size, "permutation"),), tuple(dims(v) for v in rule.operands),
                      tuple(dims(v) for v in rule.results))
    return Link(op.id, op.primitive, rule, op.linked_inputs, op.linked_outputs, frozenset(), False)
