"""The buffers XLA:CPU adds around convolutions, as the memory estimate's CPU rules
(:mod:`automap.cost.xla_cpu`) count them: the transposed copies of operands out of Eigen's order
(its ``ConvCanonicalization``) and the dense expansion of a depthwise conv's kernel gradient
(its ``ConvolutionGroupConverter``), read off what XLA:CPU compiles
(``tests/automap/cost/test_against_xla.py``).
"""
from __future__ import annotations

import math
from typing import Sequence

from automap.analysis import execution_factors
from automap.factors import compose_spec
from automap.ir.program import Op, Program
from automap.rules import traits_of
from automap.shardings import ShardingState

__all__ = ["batch_grouped", "computed_result_bytes", "conv_layout_copies", "convs_copying", "expanded_densely",
           "local_groups"]


def conv_layout_copies(op: Op, program: Program | None = None) -> tuple[bool, bool, bool]:
    """Whether XLA:CPU runs ``op`` (a ``conv_general_dilated``) on a transposed copy of its input,
    of its kernel, and writes its result transposed from a copy: its ``ConvCanonicalization`` pass
    gives every convolution that is not in Eigen's order (input and result batch, spatial...,
    feature; kernel spatial..., in, out) a transpose of each operand and of the result into that
    order, and each transpose that is not the identity is a copy. The forward conv of NHWC/HWIO
    code needs none; its weight gradient transposes all three (the batch is its contraction); its
    input gradient the kernel (in and out swapped). (False, False, False) for other ops and for
    grouped convs (XLA rewrites those first), but for a batch-grouped one that ``program`` shows
    XLA rewrites over a base-dilated dim (not :func:`expanded_densely`): that dim, inserted
    before the lhs batch and the kernel's output features, leaves neither operand in Eigen's
    order, so both are copied (its result, as a weight gradient's, adds nothing).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> x, w = jnp.ones((2, 8, 8, 4)), jnp.ones((3, 3, 4, 4))
    >>> prog = lower(jax.make_jaxpr(jax.grad(lambda x, w: (conv(x, w) ** 2).sum(), (0, 1)))(x, w), ["x", "w"], ["dx", "dw"])
    >>> [conv_layout_copies(op) for op in prog.ops if op.primitive == "conv_general_dilated"]  # forward, weight and input gradients
    [(False, False, False), (True, True, True), (False, True, False)]
    """
    numbers = op.params.get("dimension_numbers") if op.primitive == "conv_general_dilated" else None
    if numbers is None or op.params.get("feature_group_count", 1) != 1:
        return (False, False, False)
    if op.params.get("batch_group_count", 1) != 1:
        dilated = program is not None and not expanded_densely(program, op)
        return (dilated, dilated, False)
    lhs, rhs, out = numbers  # (batch, feature, spatial...), (out, in, spatial...), (batch, feature, spatial...)
    n = len(lhs)

    def activation(spec: Sequence[int]) -> bool:  # not (batch, spatial..., feature) in memory order
        return tuple(spec) != (0, n - 1, *range(1, n - 1))

    return activation(lhs), tuple(rhs) != (n - 1, n - 2, *range(n - 2)), activation(out)


def batch_grouped(program: Program, ops: Sequence[Op]) -> list[tuple[int, Op]]:
    """(position, op) of the batch-grouped convolutions in ``ops`` that XLA:CPU expands densely
    (a depthwise conv's kernel gradient, :func:`expanded_densely`)."""
    return program.memo_of(ops, ("batch_grouped",), lambda: [
        (i, op) for i, op in enumerate(ops)
        if op.primitive == "conv_general_dilated" and expanded_densely(program, op)])


def expanded_densely(program: Program, op: Op) -> bool:
    """Whether XLA:CPU's ``ConvolutionGroupConverter`` expands the batch-grouped convolution ``op``
    into a dense one and masks its diagonal: only where the lhs batch and the kernel's output
    features both hold exactly the groups (a depthwise conv's kernel gradient, one channel and
    one output a group). Any other (a grouped conv's kernel gradient, several channels a group;
    a depthwise one with a channel multiplier) it rewrites into an ungrouped convolution over
    the groups as a base-dilated spatial dim, no larger than its result (a vmapped 4-group conv
    over 128 channels: 16 groups of 8, its 12 KiB kernel gradient counted 16 times over, twice,
    393,216 B, where XLA holds 12 KiB).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> def kernel_gradient(groups):  # of a conv over 8 channels in ``groups`` groups
    ...     conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
    ...                                                      feature_group_count=groups)
    ...     dw = lambda x, w: jax.grad(lambda w: conv(x, w).sum())(w)
    ...     prog = lower(jax.make_jaxpr(dw)(jnp.ones((4, 6, 8)), jnp.ones((3, 8 // groups, 8))), ["x", "w"], ["dw"])
    ...     return prog, next(op for op in prog.ops if op.params.get("batch_group_count", 1) > 1)
    >>> expanded_densely(*kernel_gradient(8)), expanded_densely(*kernel_gradient(2))  # depthwise; 2 groups of 4
    (True, False)
    """
    groups = op.params.get("batch_group_count", 1)
    numbers = op.params.get("dimension_numbers")
    if groups == 1 or numbers is None:
        return False
    lhs, rhs = (program.values[v].shape for v in op.inputs[:2])
    return lhs[numbers[0][0]] == groups and rhs[numbers[1][0]] == groups


def computed_result_bytes(op: Op, state: ShardingState) -> int:
    """Bytes of ``op``'s result on one device as the op computes it (:func:`execution_factors`),
    before a partial sum is reduced into its stored layout: a kernel gradient over examples split
    across the devices is computed whole on each, then reduce-scattered."""
    fax = execution_factors(op, state)
    dims = op.rule.results[0] if op.rule is not None else ()
    spec = compose_spec(dims, fax, op.rule, state.axes)
    return state.program.values[op.outputs[0]].nbytes // math.prod(state.axes[a] for axes in spec for a in axes)


def local_groups(op: Op, state: ShardingState) -> int:
    """A batch-grouped convolution's groups on one device: XLA:CPU expands it into a dense
    convolution over them and keeps the diagonal, so its result is there that many times over,
    twice (the dense result and its masked copy: a 7x7 depthwise kernel gradient over 32
    channels holds 401,408 B of temporaries for a 6,272 B kernel, 25,088 B with the channels
    split 4 ways)."""
    groups = op.params["batch_group_count"]
    factor = traits_of(op.primitive).quadratic_on("cpu")
    f = factor(op.rule, **op.params) if factor is not None and op.rule is not None else None
    if f is None:
        return groups
    return groups // math.prod(state.axes[a] for a in execution_factors(op, state).get(f, ()))


def convs_copying(program: Program, ops: Sequence[Op]) -> list[tuple[int, Op, tuple[bool, bool, bool]]]:
    """(position, op, :func:`conv_layout_copies`) of the convolutions in ``ops`` that copy an operand."""
    return program.memo_of(ops, ("convs_copying",), lambda: [
        (i, op, c) for i, op in enumerate(ops) if op.primitive == "conv_general_dilated"
        for c in [conv_layout_copies(op, program)] if any(c[:2])])
