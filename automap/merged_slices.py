"""XLA:CPU's reduce-scatter whose result a reader slices further: one all-reduce.

XLA:CPU has no reduce-scatter: its partitioner sums a partial result into a split layout by an
all-reduce and a ``dynamic-slice`` of the group's share (:mod:`automap.measure` reads that pair as
a reduce-scatter). Where a reader wants the value split further than it is stored (a local slice,
no collective: the partitioner slices it again at the reader), XLA's simplifier merges the two
slices into one that keeps less than the group's share, and the all-reduce stays one: twice the
bytes sent. Measured on 8 CPU devices, mesh 4x2: a convolution's input gradient summed over
``data`` into its channels on ``data``, read by the embedding's scatter-add with its tokens split
over ``model`` too (the held-out conv1d's fsdp_tp: a 16 KiB all-reduce where the estimate had a
12 KiB reduce-scatter).

The other side of the same pair: a partial sum all-reduced whole (its result kept without the
summed axes) whose only reader, through transposes, is a ``split`` taking the value split over
exactly those axes (besides moving its other axes) is sliced there locally by the partitioner, right after the
all-reduce, keeping the group's share: :mod:`automap.measure` reads the pair as a reduce-scatter,
half the bytes on 2 devices ((n - 1)/n of the result against 2 (n - 1)/n). Measured on 8 CPU
devices, mesh 4x2: a (32, 128) weight gradient summed over 'data' into ('model', -) (after its
transpose), read by a ``split`` whose pieces are on ('data', 'model') (the held-out flax LSTM's
input kernel under ``fsdp``: 200 KiB of all-reduce over its 16 steps where XLA's measure has
half; its 4 gates of 16 over the 8 devices of a 1-D mesh, windows cut by the blocks: 14 KiB where
XLA's measure has 7). A reader that slices over more axes than the sum's merges the slices: an
all-reduce still; so does a split one of whose pieces every device windows from its own block.
An elementwise reader keeps the all-reduce too (sequence parallelism's position add reading the
embedding gather's sum, measured as an all-reduce: ``tests/tactics/test_sequence_parallel.py``).
"""
from __future__ import annotations

from typing import Sequence

from automap.factors import Axes, compose_spec
from automap.shardings import ShardingState
from automap.split_moves import moves_whole_pieces
from automap.split_windows import windows_all_permuted


PASSED_THROUGH = ("transpose",)  # ops XLA's measure follows from an all-reduce to its slice


def sliced_once(state: ShardingState, analyses: Sequence, index: dict[int, int], vid: int, summed: Axes) -> bool:
    """Whether value ``vid``, all-reduced over ``summed``, is read (through unresharded
    transposes) by one ``split`` alone whose pieces XLA moves (whole pieces per device's block:
    :func:`automap.split_moves.moves_whole_pieces`; or windows cut by the blocks, each piece's
    fetched in part from other devices: :func:`automap.split_windows.windows_all_permuted`, a
    flax LSTM's 4 gates of 16 over 8 devices) that runs it split over exactly the axes
    ``summed`` more than it is stored (others may move between dims): the all-reduce and the
    reader's local slice are a reduce-scatter to XLA's measure (module docstring). Seen through
    :func:`automap.analysis.reshards`, which asks it of each all-reduce of a result:

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import reshards
    >>> from automap.ir.lower import lower
    >>> f = lambda x, w: jnp.split(x @ w, 4, axis=1)  # x @ w summed over 'data', then split
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((32, 64)), jnp.ones((64, 128))), ["x", "w"], list("abcd"))
    >>> def pieces_on(spec):
    ...     specs = {0: ((), ("data",)), 1: (("data",), ()), 2: ((), ())} | {v: spec for v in prog.outputs}
    ...     return ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs=specs)
    >>> [[r.kind for r in reshards(pieces_on(spec)) if r.op == 0] for spec in [((), ("data",)), ((), ("model",))]]
    [['reduce-scatter'], ['all-reduce']]
    """
    program = state.program
    while True:
        readers = [op for op in program.users.get(vid, ()) if vid in op.linked_inputs]
        if len(readers) != 1 or vid in program.outputs or readers[0].id not in index:
            return False
        (op,) = readers
        fax, templates, _ = analyses[index[op.id]]
        if op.primitive in PASSED_THROUGH and not templates and len(op.linked_outputs) == 1:
            vid = op.linked_outputs[0]
            continue
        # a split alone: XLA slices its pieces right after the sum; an elementwise reader (the
        # masked embedding gather's sum read by the position add, sequence parallel) keeps the
        # all-reduce and slices later (tests/tactics/test_sequence_parallel.py)
        if not (moves_whole_pieces(op, state) or windows_all_permuted(op, state)) or op.rule is None \
                or op.linked_inputs.count(vid) != 1:
            return False
        dims = op.rule.operands[op.linked_inputs.index(vid)]
        if not dims:
            return False
        stored = {a for axes in state.spec(vid) for a in axes}
        wanted = {a for axes in compose_spec(dims, fax, op.rule, state.axes) for a in axes}
        if op.primitive == "split":  # XLA reshards the operand to its pieces' layout (automap.split_moves)
            wanted |= {a for v in op.linked_outputs for axes in state.spec(v) for a in axes}
        return bool(summed) and wanted - stored == set(summed)


def sliced_further(state: ShardingState, analyses: Sequence, index: dict[int, int], vid: int) -> bool:
    """Whether an op reading value ``vid`` runs it split further than ``vid`` is stored: each dim's
    axes a prefix of the reader's, and more axes in all (``analyses``: per walked op, its factor
    axes first; ``index``: op id -> its position there)."""
    stored = state.spec(vid)
    for op in state.program.users.get(vid, ()):
        if vid not in op.linked_inputs or op.rule is None or op.id not in index:
            continue
        fax = analyses[index[op.id]][0]
        for pos, v in enumerate(op.linked_inputs):
            if v != vid or not op.rule.operands[pos]:
                continue
            wanted = compose_spec(op.rule.operands[pos], fax, op.rule, state.axes)
            if all(tuple(w[: len(s)]) == tuple(s) for s, w in zip(stored, wanted, strict=True)) and \
                    sum(map(len, wanted)) > sum(map(len, stored)):
                return True
    return False
