"""How XLA's partitioner moves the pieces of a ``split`` that keeps them split along the split dim.

automap's rule for ``split`` keeps the split dim whole (:func:`automap.rules.shape._split`): the
operand's axes there are gathered, and pieces wanted split along it are sliced locally. XLA
(jax 0.10.2, Shardy) hands the partitioner one ``slice`` per piece whose sliced dim is a
permutation factor shared with the operand (:func:`automap.shardy_shape_rules.split_as_shardy`): where
the pieces are split along that dim over axes ``A``, it first reshards the operand to the pieces'
layout, ``A`` on the split dim (a dim where the operand holds more axes than the pieces keeps
them), then moves each piece's share from the device holding it by collective-permutes, one per
(piece, source, target): n (n - 1) of a 1/n² of the operand's local block for n pieces over n
devices, as many bytes as an all-gather of that block over ``A`` sends (the ring's (n - 1)/n of
it), then reshards each piece to its own layout. The estimate prices the permutes as that
all-gather (a split whose operand is already in the pieces' layout was priced so before) where
each device's block of the split dim holds whole pieces (:func:`_whole_pieces`: 4 or 8 pieces
over 'model', 2 or 6 over 'data', exact); where a block cuts a piece XLA's permutes differ:
:mod:`automap.split_windows` prices them.

Measured on 8 CPU devices, mesh 2x4, a (32, 128) array split into four (32, 32) pieces on
('data', 'model'): from ('data', 'model') twelve 512 B permutes (6,144 B sent; the all-gather the
estimate had, 6,144 B); from a whole operand the same twelve (the estimate had nothing: each
piece a local slice); from ('model', -) an all-to-all and a permute to ('data', 'model') (2,560
B, as the estimate now prices it, :func:`automap.tile_order.displaced_axes`) and the twelve (the estimate had an all-to-all of
each piece, 768 B in all; the held-out flax LSTM's input-kernel gradient in its backward scan,
``fsdp``: 136 KiB sent there against 12 KiB estimated, 0.86x XLA's bytes for the plan).
"""
from __future__ import annotations

import itertools
import math
from typing import Callable

from automap.factors import compose_spec, split_dim
from automap.rules.registry import Factor, FactorRule
from automap.shardings import ShardingState, Spec
from automap.split_windows import pieces_windowed
from automap.xla_loops import Link

Templates = tuple  # (linked position, kind, axes, bytes, where), as automap.analysis makes them


def pieces_moved(op, state: ShardingState, templates: Callable[[Link, ShardingState, dict], Templates]) -> Templates | None:
    """The reshard templates of ``op``, a ``split`` whose pieces all take one layout with axes on
    the split dim, as XLA moves them (module docstring; where blocks cut pieces,
    :func:`automap.split_windows.pieces_windowed`); None for any other op or layout.
    ``templates``: :func:`automap.analysis._templates`, which prices the operand's and the pieces'
    reshards on a rule that shares the split dim.

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import _templates
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda g: jnp.split(g, 4, axis=1))(jnp.ones((32, 128))), ["g"], list("abcd"))
    >>> pieces = {v: (("data",), ("model",)) for v in prog.outputs}
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs={prog.inputs[0]: ((), ()), **pieces})
    >>> pieces_moved(prog.ops[0], state, _templates)  # the whole operand sliced, the pieces' 8 KiB block moved
    ((0, 'all-gather', ('model',), 8192, 'operand'),)
    """
    if not moves_whole_pieces(op, state):
        return pieces_windowed(op, state)  # blocks that cut pieces
    piece = state.spec(op.linked_outputs[0])
    axis = op.params["axis"] % len(piece)
    along = tuple(piece[axis])
    shared = _shared_rule(op, axis)
    run = _run_spec(state.spec(op.linked_inputs[0]), piece, axis)
    fax: dict[int, tuple[str, ...]] = {}
    for dim, axes in zip(shared.rule.operands[0], run, strict=True):
        if axes:
            fax.update(split_dim(axes, dim, shared.rule, state.axes))
    if compose_spec(shared.rule.operands[0], fax, shared.rule, state.axes) != run:
        return None  # a layout the shared rule cannot express
    rest = tuple(tuple(a for a in axes if a not in along) for axes in run)
    block = state.program.values[op.linked_inputs[0]].nbytes // math.prod(state.axes[a] for axes in rest for a in axes)
    return templates(shared, state, fax) + ((0, "all-gather", along, block, "operand"),)


def moves_whole_pieces(op, state: ShardingState) -> bool:
    """Whether ``op`` is a ``split`` whose pieces all take one layout with axes on the split dim,
    each device's block of that dim holding whole pieces: XLA reshards its operand to the pieces'
    layout and moves them (module docstring).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda g: jnp.split(g, 4, axis=1))(jnp.ones((32, 128))), ["g"], list("abcd"))
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4})
    >>> on = lambda spec: state.replace(specs={v: spec for v in prog.outputs})
    >>> moves_whole_pieces(prog.ops[0], on(((), ("model",)))), moves_whole_pieces(prog.ops[0], on((("data",), ())))
    (True, False)
    """
    if op.primitive != "split":
        return False
    layouts = {state.spec(v) for v in op.linked_outputs}
    if len(layouts) != 1:
        return False
    (piece,) = layouts
    along = piece[op.params["axis"] % len(piece)]
    return bool(along) and _whole_pieces(op, math.prod(state.axes[a] for a in along))


def _whole_pieces(op, n: int) -> bool:
    """Whether each of ``n`` equal blocks of the split dim holds whole pieces (every block's edge
    a piece's): then XLA's permutes send what the all-gather would. Where a block holds part of a
    piece they do not (measured, a whole (32, W) operand: 3 pieces over 'data' 8,192 B against the
    all-gather's 6,144, 3 over 'model' 10,240 against 9,216, 4 over ('data', 'model') 5,632
    against 7,168, 2 over ('data', 'model') 2,560 against 7,168; a flax LSTM cell of width 16, its
    4 gates over 8 devices, 5.5 KiB against 7.0): the estimate keeps its slices there."""
    sizes = [int(s) for s in op.params["sizes"]]
    total = sum(sizes)
    edges = set(itertools.accumulate(sizes))
    return total % n == 0 and all(total // n * k in edges for k in range(1, n))


def _shared_rule(op, axis: int) -> Link:
    """``op``'s rule with the split dim one factor shared by the operand and every piece (the
    size the pieces' sizes have in common), as Shardy's slice rule has it, but parallel: the
    permutes are priced apart."""
    rule = op.rule
    shared = len(rule.factors)
    dims = lambda all_dims: tuple(tuple((shared,) if d == axis else fs for d, fs in enumerate(v))  # noqa: E731
                                  for v in all_dims)
    size = math.gcd(*map(int, op.params["sizes"]))
    return Link(op.id, op.primitive, FactorRule(rule.factors + (Factor(size),), dims(rule.operands), dims(rule.results)),
                op.linked_inputs, op.linked_outputs, frozenset(), False)


def _run_spec(operand: Spec, piece: Spec, axis: int) -> Spec:
    """The operand's layout XLA slices the pieces from: the pieces', but a dim where the operand
    holds the pieces' axes and more keeps the operand's (a (32, 128) operand on ('data', -) split
    into pieces on (-, 'model'): sliced on ('data', 'model'), each piece gathered over data after)."""
    run = list(piece)
    for d, (have, want) in enumerate(zip(operand, piece, strict=True)):
        extra = have[len(want):]
        if d != axis and have[: len(want)] == want and not {a for axes in run for a in axes} & set(extra):
            run[d] = have
    return tuple(run)
