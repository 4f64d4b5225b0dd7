"""Which gathers XLA's SPMD partitioner (jax 0.10.2) shares between the ops that use one value.

The partitioner reshards an operand once per target layout and XLA's CSE merges equal
collectives, so a value gathered for one dot is mostly the gather another dot reuses
(:func:`automap.analysis.reshards` marks the later ones ``reused``). Two exceptions were
measured: a gather written with another form of replica groups (:func:`gathered_apart`), and
a gather made inside the partition groups of a dot grouped on its sum (:func:`grouped_on_the_sum`).
"""
from __future__ import annotations

from automap.contraction_layouts import CONTRACTIONS, Templates, batch_groups_split_within, shared_sums
from automap.factors import Axes
from automap.ir.program import Op
from automap.whole_gathers import summed_whole_in_groups


def gathered_apart(op: Op, templates: Templates, state=None) -> int | None:
    """The operand position (else None) of a contraction's gather that XLA's CSE shares with no
    other gather of the same value: where the contraction gathers both its operands, the larger
    (per device, once gathered; the first operand on a tie). XLA's partitioner writes that
    gather's replica groups in another form than the value's other gathers (an iota list against
    named mesh axes, or the reverse), and its CSE merges only equal forms. Measured on jax 0.10.2,
    a convolution with its kernel gradient (and ``x @ w`` with ``x.T @ dy``) under FSDP on meshes
    4x2, 2x4 and 2x2, the input's batch on 'data' and its features on 'model', the kernel's
    (or ``w``'s) on ('data', 'model'): the forward gathers both operands, the gradient the input
    again; XLA reused the input's first gather on 5 of 16 shapes, exactly those where it is the
    smaller operand (a ResNet's FSDP plan on 2x4: the estimate had assumed it reused). Given the
    op's ``state``, None where the dot gathers its operands for groups of devices and sums whole
    (:func:`automap.whole_gathers.summed_whole_in_groups`): the partner's whole gather is shared;
    and where a batch-grouped conv runs whole (:func:`automap.contraction_layouts.batch_groups_split_within`).

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import op_analyses
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> prog = lower(jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((8, 16)), jnp.ones((16, 64))), ["x", "w"], ["y"])
    >>> (x, w), (y,), dot = prog.inputs, prog.outputs, prog.ops[0]
    >>> fsdp = {x: (("data",), ("model",)), w: (("data", "model"), ())}
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs={**fsdp, y: (("data",), ("model",))})
    >>> gathered_apart(dot, op_analyses(state)[0][1])  # x gathered over 'model' (256 B), w whole (4 KiB): w
    1
    >>> state = state.replace(specs={**fsdp, y: (("data",), ())})  # w alone gathered
    >>> print(gathered_apart(dot, op_analyses(state)[0][1]))
    None
    """
    if op.primitive not in CONTRACTIONS:
        return None
    gathers = [(nbytes, pos) for pos, kind, _, nbytes, where, *_ in templates if kind == "all-gather" and where == "operand"]
    if len(gathers) != 2 or gathers[0][1] == gathers[1][1]:
        return None
    if state is not None and (summed_whole_in_groups(op, state) is not None or batch_groups_split_within(op, state)):
        return None
    return max(gathers)[1] if gathers[0][0] != gathers[1][0] else gathers[0][1]


def grouped_on_the_sum(op: Op, state, templates: Templates) -> Axes:
    """The axes a dot's partition groups are made over where XLA's dot partitioner (jax 0.10.2)
    groups it on its summed dims (() where it does not): its operands split the sum alike, its
    result is no larger than its larger operand and its partial result is reduce-scattered
    (``templates``: the dot as it runs). The operands are resharded inside the groups, new
    instructions the partitioner's reshard cache does not hold: a gather there is not the one
    made outside (it is shared only with the gathers of other dots grouped so). Measured on a
    dense layer's gradient, mesh 2x4, ``h`` (model, -, data), its weight (model, data): ``h``
    gathered over data for the forward dot and again for the weight gradient (16 KiB, under
    ``h``'s 64 KiB, reduce-scattered over 'model'); the weight gathered once for the forward
    dot and the input gradient (64 KiB, over both 16 KiB operands); with the weight (-, data),
    the weight gradient all-reduced: ``h`` gathered once. An attention's FSDP backward
    (nnx_transformer): the query/key/value weight gradients gather their input apart from the
    forward dots, once for the three.

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import op_analyses
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> f = lambda x, dy: jnp.einsum("bsd,bsh->dh", x, dy)  # a dense layer's weight gradient
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((8, 4, 16)), jnp.ones((8, 4, 32))), ["x", "dy"], ["dw"])
    >>> (x, dy), (dw,), dot = prog.inputs, prog.outputs, prog.ops[0]
    >>> specs = {x: (("data",), (), ()), dy: (("data",), (), ("model",)), dw: ((), ("model", "data"))}
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs=specs)
    >>> grouped_on_the_sum(dot, state, op_analyses(state)[0][1])  # summed on 'data', reduce-scattered
    ('data',)
    >>> state = state.replace(specs={**specs, dw: ((), ("model",))})  # all-reduced over 'data'
    >>> grouped_on_the_sum(dot, state, op_analyses(state)[0][1])
    ()
    """
    shared = shared_sums(op, state)
    if shared is None:
        return ()
    values = state.program.values
    if values[op.linked_outputs[0]].nbytes > max(values[v].nbytes for v in op.linked_inputs):
        return ()
    if not any(kind == "reduce-scatter" and where == "result" for _, kind, _, _, where, *_ in templates):
        return ()
    return tuple(a for a in state.axes if any(a in axes for axes in shared[0].values()))
