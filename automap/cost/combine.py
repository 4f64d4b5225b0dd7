"""Which collectives XLA combines into one: independent collectives pay one latency.

XLA's combiner passes (all-reduce, all-gather and reduce-scatter combiners) merge collectives of
the same kind over the same devices when neither depends on the other, up to a size threshold:
the gradient all-reduces of data parallelism, one per parameter, compile to one or a few
all-reduces. The bytes on the wire are unchanged; what is saved is the per-collective latency.

The model: a collective's *height* is the longest chain of collectives that depends on it (the
gradient all-reduces that only the optimizer reads have height 0). Two collectives with the same
height cannot depend on each other (a dependent one would be higher), so collectives of one kind,
over the same mesh axes, in the same region and at the same height form a combinable group; the
group pays one latency per ``COMBINE_THRESHOLD_BYTES`` of its bytes.
"""
from __future__ import annotations

from typing import Sequence

COMBINE_THRESHOLD_BYTES = 30 * 2**20  # XLA's GPU combiners' default threshold (30 MiB)
# what XLA combines, per platform (Topology.platform): XLA:CPU runs only the all-reduce combiner
# (measured: 30 reduce-scatters stay 30 on the 2-layer GPT), GPU and TPU all three
COMBINED_KINDS = {"cpu": ("all-reduce",)}
DEFAULT_KINDS = ("all-reduce", "all-gather", "reduce-scatter")


def combined_kinds(topology) -> tuple[str, ...]:
    return COMBINED_KINDS.get(topology.platform, DEFAULT_KINDS)

GroupKey = tuple  # (kind, axes, region, count, height)


def combine_groups(program, reshards: Sequence) -> list[GroupKey]:
    """The combine group of each reshard (in the order given), by one backward walk over the
    program's ops."""
    by_op: dict[int, list[int]] = {}
    for i, r in enumerate(reshards):
        by_op.setdefault(r.op, []).append(i)
    height = [0] * len(program.values)
    keys: list[GroupKey | None] = [None] * len(reshards)
    mine_of = by_op.get
    for op_id, outputs, inputs, region in _backward_walk(program):
        # most ops have one output: no list built (this loop runs over every op for every estimate)
        h = height[outputs[0]] if len(outputs) == 1 else max([height[v] for v in outputs], default=0)
        mine = mine_of(op_id)
        if mine is None:  # most ops: pass the height on to the inputs
            if h:
                for v in inputs:
                    if height[v] < h:
                        height[v] = h
            continue
        results = [i for i in mine if reshards[i].where == "result"]
        for i in results:
            keys[i] = _key(reshards[i], region, h)
        h += bool(results)  # a result reshard depends on every input
        resharded = set()
        for i in mine:
            if reshards[i].where == "operand":
                keys[i] = _key(reshards[i], region, h)
                resharded.add(reshards[i].value)
        for v in inputs:  # an operand reshard depends only on the operand it reshards
            hv = h + (v in resharded)
            if height[v] < hv:
                height[v] = hv
    return keys  # type: ignore[return-value]


def _backward_walk(program) -> list[tuple[int, tuple[int, ...], tuple[int, ...], int]]:
    """(op id, outputs, inputs, region) of every op, last first (memoised per program)."""
    got = program.memo.get("combine_walk")
    if got is None:
        got = program.memo["combine_walk"] = [
            (op.id, op.outputs, op.inputs, program.values[op.outputs[0]].region if op.outputs else 0)
            for op, _ in reversed(program.walked)
        ]
    return got


def _key(r, region: int, height: int) -> GroupKey:
    return (r.kind, tuple(sorted(r.axes)), region, r.count, height)


def latency_charges(
    keys: Sequence[GroupKey], sizes: Sequence[int], kinds: Sequence[str] = DEFAULT_KINDS
) -> list[bool]:
    """Per collective: whether it pays a latency. Within a group, the first one does, and one
    more each time the group's bytes so far cross another multiple of the threshold; kinds that
    are not combined always do.

    >>> key = ("all-reduce", ("data",), 0, 1, 0)  # kind, axes, region, count, height
    >>> latency_charges([key, key, ("all-gather",) + key[1:]], [8, 8, 8], kinds=("all-reduce",))
    [True, False, True]
    """
    seen: dict[GroupKey, int] = {}
    out = []
    for key, nbytes in zip(keys, sizes, strict=True):
        if key[0] not in kinds:
            out.append(True)
            continue
        before = seen.get(key)
        total = (before or 0) + nbytes
        seen[key] = total
        out.append(before is None or total // COMBINE_THRESHOLD_BYTES > before // COMBINE_THRESHOLD_BYTES)
    return out
