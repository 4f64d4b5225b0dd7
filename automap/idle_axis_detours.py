"""A contraction that leaves a mesh axis idle, as XLA's dot partitioner (jax 0.10.2) splits it
over that axis too: the operand gathers and result scatters it needs become detours over the idle
axis. A rule of :func:`automap.contraction_layouts.as_xla_contracts`.
"""
from __future__ import annotations

import math

from automap.factors import Axes, compose_spec
from automap.ir.program import Op


def idle_axis_detours(op: Op, state, fax: dict[int, Axes], templates: tuple) -> tuple[tuple, int]:
    """(templates, how many more ways the op's work is split) as XLA's dot partitioner (jax 0.10.2)
    runs a contraction that leaves a mesh axis idle (no factor, operand or result of it on the
    axis) at least as large as the group of a reshard it needs: it splits the dot over the idle
    axis too and moves the pieces into place with a collective-permute. An operand all-gather over
    ``A`` (S bytes gathered) becomes a collective-permute of S/m over ``A`` and the idle axis (m
    devices) and an all-gather over the idle axis; a result reduce-scatter over ``A`` (n devices,
    S bytes) an all-reduce over ``A`` of S/n and a collective-permute of S/n, the dot's work split n
    more ways. Twice the bytes the plain collective sends, on every dot measured (mesh 2x4 and
    2x2, batched and plain, FSDP's weight gathers and gradient scatters with 'model' idle), and on
    convolutions, which XLA partitions as dots (a kernel gathered for the forward conv, its
    gradient scattered, mesh 2x4: the resnet's fsdp_tp plan); an idle axis smaller than the group
    leaves the plain collective. An operand gathered along a summed dim whose result is smaller
    than it (the result's bytes per device in its layout ``R`` below the gathered operand's ``S``)
    is instead permuted so that the idle axis splits the sum, and the partial results all-reduced
    over it, the work split m more ways (measured: a conv whose kernel is split on its input
    features with a 2 KiB result, and with an 8 KiB result against a 12 KiB kernel (a held-out
    haiku Conv1D under fsdp_tp); ``x @ w`` with ``w`` split on its rows, 4 KiB and 64 KiB,
    results from 512 B up to 3,840 and 63,488 B: summed; at ``R == S`` and above XLA gathers, as
    it gathers the 9 KiB kernel of a 64 KiB result; the rule was ``2 R < S`` before, 4x XLA's dot
    FLOPs between). Other contractions (a ragged dot is a masked dense dot on CPU) are left as they
    are: not measured. Nor is a convolution whose factors are all kept whole (a grouped conv that
    is not depthwise, :func:`automap.rules.dot._conv`): XLA does not partition it as a dot but
    gathers its operands plainly (measured: a haiku ``DepthwiseConv2D``'s input gradient, channel
    multiplier 2, stride 2, the output's gradient on 'data' with 'model' idle: one all-gather over
    'data', where the detour priced 1.6x its bytes).

    What it makes of ``x @ w`` under FSDP on 'data' with 'model' idle (through
    :func:`automap.analysis.reshards`, which applies it): ``w``'s rows permuted so that 'model'
    splits the sum too, and the partial results all-reduced over it, rather than ``w`` gathered.

    >>> import jax, jax.numpy as jnp, automap.analysis, automap.ir.lower, automap.shardings
    >>> jaxpr = jax.make_jaxpr(jnp.matmul)(jnp.ones((8, 16)), jnp.ones((16, 64)))
    >>> prog = automap.ir.lower.lower(jaxpr, ["x", "w"], ["y"])
    >>> fsdp = {v: (("data",), ()) for v in prog.inputs + prog.outputs}  # x's rows, w's rows, y's rows
    >>> state = automap.shardings.ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs=fsdp)
    >>> [(r.kind, r.axes, r.bytes) for r in automap.analysis.reshards(state)]
    [('collective-permute', ('data', 'model'), 1024), ('all-reduce', ('model',), 1024)]
    """
    if not templates or op.primitive not in ("dot_general", "conv_general_dilated"):  # measured on these alone
        return templates, 1
    if all(f.kind == "blocked" for f in op.rule.factors):  # run whole, not as a dot: its operands gathered
        return templates, 1
    sizes = state.axes
    used = {a for axes in fax.values() for a in axes}
    used.update(a for v in op.linked for axes in state.spec(v) for a in axes)
    idle = [a for a, n in sizes.items() if n > 1 and a not in used]
    if not idle:
        return templates, 1
    out, split = [], 1
    for pos, kind, axes, nbytes, where, *_ in templates:
        n = math.prod(sizes[a] for a in axes)
        spare = next((a for a in idle if sizes[a] >= n), None)
        if where == "operand" and not _partners_in_place(op, state, fax, pos):
            spare = None  # the partner resharded into the dot's layout: this operand gathered plainly
        if spare is None or (kind, where) not in (("all-gather", "operand"), ("reduce-scatter", "result")):
            out.append((pos, kind, axes, nbytes, where))
            continue
        both = tuple(a for a in sizes if a in axes or a == spare)
        m = sizes[spare]
        partial = _summed_partial_bytes(op, state, fax, pos, axes) if kind == "all-gather" else None
        if partial is not None and partial < nbytes:  # a result smaller than the gathered operand: summed over the idle axis
            out += [(pos, "collective-permute", both, nbytes // m, where),
                    (len(op.linked_inputs), "all-reduce", (spare,), partial, "result")]
            split *= m
        elif kind == "all-gather":
            out += [(pos, "collective-permute", both, nbytes // m, where),
                    (pos, "all-gather", (spare,), nbytes, where)]
        else:
            out += [(pos, "all-reduce", axes, nbytes // n, where), (pos, "collective-permute", both, nbytes // n, where)]
            split *= n
    return tuple(out), split


def _partners_in_place(op: Op, state, fax: dict[int, Axes], pos: int) -> bool:
    """Whether every operand but ``pos`` is held as the op runs it (``fax``): XLA's dot partitioner
    takes its detour over an idle axis only there, in the groups the partner's split makes; a
    partner it must move or slice into the result's layout first (an all-to-all, or a local slice
    of a whole partner) it reshards so, and gathers ``pos`` plainly, whole. Measured on jax 0.10.2,
    mesh 2x4, a weight gradient ``bsn,bsk->nk`` (the result's rows on 'data', ``x``'s features on
    'data', 'model' idle) and a forward ``bsk,kn->bsn`` (the result's columns on 'data'): the
    cotangent (or the weight) on its batch (or rows), or whole, ``x`` all-gathered over 'data';
    the partner already on the result's rows, ``x`` permuted onto 'model' and gathered over it
    (the held-out Hugging Face GPT-2's ``fsdp_tp`` c_attn gradients: 1.57x XLA's bytes sent there)."""
    rule, sizes = op.rule, state.axes
    for other, (vid, dims) in enumerate(zip(op.linked_inputs, rule.operands, strict=True)):
        if other != pos and dims and tuple(map(tuple, state.spec(vid))) != tuple(map(tuple, compose_spec(dims, fax, rule, sizes))):
            return False
    return True


def _summed_partial_bytes(op: Op, state, fax: dict[int, Axes], pos: int, axes: Axes) -> int | None:
    """Bytes per device of the op's (first) result in its layout, where its operand ``pos`` is
    gathered over ``axes`` along a dim the op sums over (else None)."""
    rule, sizes = op.rule, state.axes
    summed = set(rule.reduction_factors)
    spec, dims = state.spec(op.linked_inputs[pos]), rule.operands[pos]
    if not op.linked_outputs or not any(set(a) & set(axes) and fs and set(fs) <= summed
                                        for a, fs in zip(spec, dims, strict=True)):
        return None
    implied = compose_spec(rule.results[0], fax, rule, sizes)
    return state.program.values[op.linked_outputs[0]].nbytes // math.prod(sizes[a] for axes in implied for a in axes)
