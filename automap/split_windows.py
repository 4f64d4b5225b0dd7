"""How XLA's partitioner moves the pieces of a ``split`` whose blocks of the split dim cut pieces.

Where each device's block of the split dim holds whole pieces, XLA's permutes send what an
all-gather of the operand's block would (:mod:`automap.split_moves`). Where blocks cut pieces
(the cotangent of a concatenation of 4 + 32 + 32 + 2 features split into its pieces over
'model', a GNN's MLP inputs), XLA (jax 0.10.2) slices each piece as a windowed input: it reshards
the operand to the pieces' layout (:func:`operand_moves`), then device ``i`` of ``n`` takes its
window ``[s + i c, s + (i + 1) c)`` of a piece at offset ``s`` (``c`` = the piece's block)
from the devices whose blocks (``b``) overlap it. Windows far from their blocks (a halo over
``2 c``) are fetched by rounds of collective-permutes, each source sending one range and each
target receiving one per round, a permute as wide as the ranges its sources send together;
nearer ones by one permute per neighbour distance, left then right
(:func:`window_permutes`). A piece nothing reads is not sliced.

Measured on 8 CPU devices, a (16, D) operand split along D with operand and pieces on the
same axes, the permutes' widths against :func:`split_permutes`' (all equal but one): (32, 32)
over 'model' 16, 8, 8, 8; (4, 32, 32, 2) over 'model' 16, 8, 8, 8 and five of 1; (10, 30, 24)
over ('data', 'model') twelve, 1 to 8; (32, 32, 32) over 'data' 32, 32; (30, 40) over 'model'
2, 4, 6, 10, 18; (3, 5, 7) over 'model' 3, 2, 2, 1, 1, 1 against 3, 2, 2, 1, 1, 1, 1. The held-out
jraph GNN's ``fsdp``: 88 KiB of such permutes the estimate did not have (0.89x XLA's bytes sent).
"""
from __future__ import annotations

import math
from typing import Mapping

from automap.shardings import ShardingState

Templates = tuple  # (linked position, kind, axes, bytes, where), as automap.analysis makes them


def pieces_windowed(op, state: ShardingState) -> Templates | None:
    """The reshard templates of ``op``, a ``split`` whose read pieces take one layout with axes
    on the split dim and the operand's on every other dim (or split where the operand has it
    whole: each device slices its block there first, sending nothing), as XLA moves them (module
    docstring); None for any other op or layout, and where XLA's move is not modelled.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda g: jnp.split(g, [32], axis=1))(jnp.ones((16, 64))), ["g"], ["a", "b"])
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4})
    >>> state = state.replace(specs={v: ((), ("model",)) for v in (*prog.inputs, *prog.outputs)})
    >>> moves = pieces_windowed(prog.ops[0], state)
    >>> {(kind, axes) for _, kind, axes, _, _ in moves}, [n // 64 for *_, n, _ in moves]  # columns of 16 rows
    ({('collective-permute', ('model',))}, [16, 8, 8, 8])
    """
    if op.primitive != "split":
        return None
    program = state.program
    read = [v for v in op.linked_outputs if _read(program, op, v)]
    layouts = {state.spec(v) for v in read}
    if len(layouts) != 1:
        return None
    (piece,) = layouts
    axis = op.params["axis"] % len(piece)
    along, operand = tuple(piece[axis]), state.spec(op.linked_inputs[0])
    if not along or any(have not in (want, ()) for d, (have, want) in enumerate(zip(operand, piece, strict=True)) if d != axis):
        return None  # another dim whole in the operand is a local slice to the pieces' blocks
    value = program.values[op.linked_inputs[0]]
    dim = value.shape[axis]
    row = value.nbytes // dim // math.prod(state.axes[a] for d, axes in enumerate(piece) if d != axis for a in axes)
    moves = operand_moves(tuple(operand[axis]), along, dim, state.axes)
    if moves is None:
        return None
    out = [(0, "collective-permute", axes, width * row, "operand") for axes, width in moves]
    n, start = math.prod(state.axes[a] for a in along), 0
    for k, (vid, size) in enumerate(zip(op.linked_outputs, map(int, op.params["sizes"]), strict=True)):
        if vid in read:
            widths = window_permutes(start, size, dim, n)
            if widths is None:
                return None
            out += [(1 + k, "collective-permute", along, width * row, "result") for width in widths]
        start += size
    return tuple(out)


def windows_all_permuted(op, state: ShardingState) -> bool:
    """Whether ``op`` is a ``split`` :func:`pieces_windowed` prices each read piece of which some
    device fetches part of its window of from another's block. XLA slices such a piece from its
    neighbours' halos joined to the local block; a piece every device windows from its own block
    is one ``dynamic-slice`` of the operand, which XLA's simplifier merges with the slice that
    reshards the operand to the pieces' layout (:mod:`automap.merged_slices`: a partial sum
    all-reduced before the split then stays an all-reduce to XLA's measure; measured on 8 CPU
    devices, a (48, 8) weight gradient summed over 'data' into 3 pieces on 'data' of the 2x4
    mesh: the middle piece's windows lie in their blocks, an all-reduce; on 'data' of an 8-device
    mesh none do, a reduce-scatter). Blocks padded past the split dim keep the all-reduce too (the
    held-out jraph GNN's 70 features over 'model', ``fsdp``).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda g: jnp.split(g, 3, axis=1))(jnp.ones((8, 48))), ["g"], list("abc"))
    >>> def on(axes):
    ...     state = ShardingState.initial(prog, axes)
    ...     return windows_all_permuted(prog.ops[0], state.replace(specs={v: ((), ("data",)) for v in prog.outputs}))
    >>> on({"data": 8}), on({"data": 2, "model": 4})
    (True, False)
    """
    templates = pieces_windowed(op, state)
    if templates is None:
        return False
    read = [k for k, v in enumerate(op.linked_outputs) if _read(state.program, op, v)]
    piece = state.spec(op.linked_outputs[read[0]])
    axis = op.params["axis"] % len(piece)
    if state.program.values[op.linked_inputs[0]].shape[axis] % math.prod(state.axes[a] for a in piece[axis]):
        return False  # padded blocks (70 features over 4): no slice keeps the group's share, an all-reduce
    moved = {pos - 1 for pos, *_, where in templates if where == "result"}
    return all(k in moved for k in read)


def _read(program, op, vid: int) -> bool:
    """Whether a piece is read: by an op, a program output or, inside a region, anything (XLA
    drops a top-level slice nothing reads)."""
    value = program.values[vid]
    return value.region != 0 or vid in program.outputs or any(o is not op for o in program.users_of[vid])


def operand_moves(have: tuple, want: tuple, dim: int, sizes: Mapping[str, int]) -> list[tuple[tuple, int]] | None:
    """The permutes (axes, width along the split dim) that reshard a dim of ``dim`` elements from
    blocks over ``have`` to blocks over ``want`` as XLA does before slicing: none from a whole dim
    or the same axes; between disjoint axes into blocks no larger, one permute of the new block
    (over both axes), and one of the widest part of a new block past the old block holding its
    start (over ``have``: 70 features from 'data' to 'model', blocks 35 and 18, sent 18 + 1);
    None otherwise (not modelled).

    >>> operand_moves(("data",), ("model",), 70, {"data": 2, "model": 4})
    [(('data', 'model'), 18), (('data',), 1)]
    """
    if not have or have == want:
        return []
    if set(have) & set(want):
        return None
    old, new = -(-dim // math.prod(sizes[a] for a in have)), -(-dim // math.prod(sizes[a] for a in want))
    if new > old:
        return None
    past = max(min((j + 1) * new, dim) - (j * new // old + 1) * old for j in range(-(-dim // new)))
    both = tuple(a for a in sizes if a in have or a in want)
    return [(both, new)] + ([(have, past)] if past > 0 else [])


def split_permutes(sizes: list[int], n: int) -> list[int] | None:
    """The permutes' widths of a split into pieces of ``sizes`` over ``n`` devices, operand and
    pieces on the same axes (module docstring).

    >>> split_permutes([32, 32], 4)
    [16, 8, 8, 8]
    """
    out, start = [], 0
    for size in sizes:
        widths = window_permutes(start, size, sum(sizes), n)
        if widths is None:
            return None
        out += widths
        start += size
    return out


def window_permutes(start: int, size: int, dim: int, n: int) -> list[int] | None:
    """The widths of the permutes that bring each of ``n`` devices its block of a piece
    ``[start, start + size)`` of a dim of ``dim`` elements in blocks over the same devices;
    None where XLA replicates instead (a window that spans most of the dim)."""
    block, piece = -(-dim // n), -(-size // n)
    left = [i * block - (start + i * piece) for i in range(n)]  # elements before a device's block it needs
    right = [start + (i + 1) * piece - (i + 1) * block for i in range(n)]  # and after it
    if max(max(left), max(right)) > 2 * piece:
        return _compact(start, piece, block, n, dim)
    return _by_distance(left, right, block, n)


def _by_distance(left: list[int], right: list[int], block: int, n: int) -> list[int] | None:
    """One permute per neighbour distance, the widest halo at that distance (left, then right)."""
    most_left, most_right = max(left[1:], default=0), max(right[:-1], default=0)
    if most_left + most_right + block >= block * n and max(most_left, most_right) > block:
        return None
    low, high = -max(left), block + max(right)  # the useful part of the neighbours' blocks
    out = []
    i = -(-most_left // block) - 1
    while i >= 0 and (-i - 1) * block < high:
        out.append(min(most_left - block * i, block) - max(-i * block - high, 0))
        i -= 1
    skipped = min(max(low - block, 0), max(most_right, 0)) // block
    out += [min(most_right - block * i, block) - max(low - (i + 1) * block, 0)
            for i in range(skipped, -(-most_right // block))]
    return out


def _compact(start: int, piece: int, block: int, n: int, dim: int) -> list[int]:
    """Rounds of permutes: each source sends its next range (nearest its window's start first),
    each target takes one per round; a permute spans the ranges its sources send."""
    ranges: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(n)]  # per source
    for i in range(n):
        lo, hi = start + i * piece, start + (i + 1) * piece
        at, k = lo, 0
        while at < min(hi, dim):
            first = at % block
            width = min(block - first, hi - at)
            if at // block != i:
                ranges[at // block].append((at - lo, k, i, first, first + width))
            at, k = at + width, k + 1
    for got in ranges:
        got.sort()
    nxt, out = [0] * n, []
    while True:
        targets: set[int] = set()
        lo, hi = block, 0
        for src in range(n):
            if nxt[src] == len(ranges[src]):
                continue
            _, _, target, a, z = ranges[src][nxt[src]]
            if targets and (target in targets or (lo > z and hi == block and a == 0) or (hi < a and lo == 0 and z == block)):
                continue  # that target has its range this round, or a far left range with a far right one
            targets.add(target)
            lo, hi = min(lo, a), max(hi, z)
            nxt[src] += 1
        if not targets:
            return out
        out.append(hi - lo)
