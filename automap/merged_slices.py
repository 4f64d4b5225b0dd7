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
"""
from __future__ import annotations

from typing import Sequence

from automap.factors import compose_spec
from automap.shardings import ShardingState


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
