"""A guard so no program automap compiles lets XLA split a batch-grouped convolution unevenly.

A grouped (not depthwise) conv's kernel gradient is a convolution with ``batch_group_count = G``
whose lhs batch dim holds ``G * b`` channels (``b > 1``). XLA's partitioner (jax 0.10.2) keeps the
result's batch ``b`` whole and checks that the lhs batch it splits is still a multiple of it
(``convolution_handler.cc:984 Check failed: new_input_batch_size % new_output_batch_size == 0``):
a split of the lhs batch, or of the kernel's or the result's output features, that does not
divide the groups aborts the whole process (``python benchmarks/grouped_conv_abort.py``; 2 groups
on mesh 2x4: the cotangent's features on 'model' abort whatever the other layouts). XLA's own
propagation reaches such a split from innocent input specs (held-out hf_regnet's default plan:
a kernel split on its output features over ('data', 'model'), the inputs-only program).

XLA also gets such a conv's numbers wrong (any batch-grouped conv, depthwise ones too): whose
groups run whole and whose sum (the examples) is split on some mesh axes alone, it all-reduces the
partial result over every device, times the idle axes' size (``python
benchmarks/grouped_conv_numbers.py``: 4x with the examples on 'data' of mesh 2x4, 2x on 'model';
the forward conv and the input gradient right). The cost model runs it with its sum split over
every axis (:func:`automap.contraction_layouts.sum_over_every_axis`), or whole, and the guard
constrains it so.

Where a mesh axis, or a product of axes, could split such a conv past its groups, or its sum be
split on some axes alone
(:func:`at_risk`), every program :func:`automap.emit.compile_plan` builds constrains the conv's
operands and its result to the layout the cost model runs it in (:func:`guarded_layouts`: its
execution factors, :func:`automap.analysis.execution_factors`, of the layout the program is
priced in), which the factor rule keeps within the groups (``automap.rules.dot._batch_grouped_conv``:
the channels within a group and the output features within a group blocked). A dim whose axes
still do not divide the groups is made whole. The pinned program, the inputs-only program, the
search's final candidates and a plan that pins nothing are all compiled through it.

>>> import jax, jax.numpy as jnp
>>> from automap.ir.lower import lower
>>> from automap.shardings import ShardingState
>>> x, dy = jnp.ones((8, 6, 16)), jnp.ones((8, 4, 16))  # a 2-group 1-D conv's kernel gradient, 16 channels
>>> grad = lambda x, dy: jax.vjp(lambda w: jax.lax.conv_general_dilated(x, w, (1,), "VALID",
...     dimension_numbers=("NWC", "WIO", "NWC"), feature_group_count=2), jnp.ones((3, 8, 16)))[1](dy)[0]
>>> prog = lower(jax.make_jaxpr(grad)(x, dy), ["x", "dy"], ["dw"])
>>> conv = next(op for op in prog.ops if op.params.get("batch_group_count", 1) > 1)
>>> at_risk(conv, {"data": 4}), at_risk(conv, {"data": 2})  # 4 does not divide 2 groups
(True, False)
>>> state = ShardingState.initial(prog, {"data": 2, "model": 4})
>>> state = state.replace(specs={**state.specs, prog.outputs[0]: ((), (), ("data", "model"))})
>>> guarded_layouts(state)[conv.id][1]  # its output features on the groups' 'data' alone, not past them
((), (), ('data',))
"""
from __future__ import annotations

import itertools
import math
from typing import Mapping

from automap.analysis import execution_factors
from automap.factors import compose_spec
from automap.ir.program import Op
from automap.shardings import ShardingState, Spec
from automap.sub_axes import on_whole_axes, whole_axis

__all__ = ["at_risk", "guarded_layouts"]


def at_risk(op: Op, sizes: Mapping[str, int]) -> bool:
    """Whether ``op`` is a batch-grouped convolution that XLA could get wrong on the mesh axes
    ``sizes``: on two axes or more, its sum split on some alone (wrong numbers, depthwise convs
    too: :func:`automap.contraction_layouts.sum_over_every_axis`); or holding more channels than
    groups (``b > 1``) that some product of the axes could split without dividing its groups (an
    abort)."""
    groups = op.params.get("batch_group_count", 1) if op.primitive == "conv_general_dilated" else 1
    numbers = op.params.get("dimension_numbers")
    if groups == 1 or numbers is None or not op.has_rule:
        return False
    if sum(n > 1 for n in sizes.values()) > 1:  # its sum could be split on some axes alone: wrong numbers
        return True
    if len(op.rule.operands[0][numbers[0][0]]) < 2:  # the lhs batch only the groups: a depthwise conv's
        return False
    ways = {math.prod(c) for n in range(1, len(sizes) + 1) for c in itertools.combinations(sizes.values(), n)}
    return any(k > 1 and groups % k for k in ways)


def guarded_layouts(state: ShardingState) -> dict[int, tuple[tuple[Spec, ...], Spec, tuple[Spec, ...]]]:
    """Op id -> (its operands' specs, its result's spec, the specs its operands and result are
    priced in) for every :func:`at_risk` convolution of ``state``'s program: the layout it runs in
    by the cost model, the lhs batch and the output-feature dims made whole where their axes
    together do not divide the groups. The program pins its operands and its result in the layout
    priced either side (a constraint on the conv's operands alone let XLA's propagation spread its
    examples' split over ('data', 'model') to the whole of held-out nnx_lora's data-parallel step:
    0.28x the FLOPs estimated)."""
    out: dict[int, tuple[tuple[Spec, ...], Spec, tuple[Spec, ...]]] = {}
    sizes: dict[str, int] = {}  # the plan's mesh: a layout of XLA's can hold sub-axes (automap.sub_axes), which
    # a NamedSharding cannot name (held-out hf_regnet's manual_fsdp failed to compile on 'model:(1)2')
    for a, n in state.axes.items():
        sizes[whole_axis(a)] = sizes.get(whole_axis(a), 1) * n
    for op, _ in state.program.walked:
        if not at_risk(op, state.axes):
            continue
        fax, rule = execution_factors(op, state), op.rule
        specs = [on_whole_axes(compose_spec(dims, fax, rule, state.axes), sizes)
                 for dims in (*rule.operands, rule.results[0])]
        lhs, rhs, res = op.params["dimension_numbers"]
        risky = ((0, lhs[0]), (1, rhs[0]), (2, res[1]))  # lhs batch, kernel and result output features
        axes = {a for i, d in risky for a in specs[i][d]}
        if op.params["batch_group_count"] % math.prod(sizes[a] for a in axes):
            for i, d in risky:
                specs[i] = tuple(() if k == d else dim for k, dim in enumerate(specs[i]))
        priced = tuple(on_whole_axes(state.spec(v), sizes) for v in (*op.inputs, op.outputs[0]))
        out[op.id] = (tuple(specs[:2]), specs[2], priced)
    return out

