"""Reshards between layouts that order a dim's tiles differently, as XLA's partitioner moves them.

A dim split over several mesh axes is tiled major to minor: over ('data', 'model') device
(d, m) holds tile ``4 d + m`` of 8, over ('model', 'data') tile ``2 m + d``, over 'model' alone
tile ``m`` of 4 (the 8-tiles ``2 m`` and ``2 m + 1``). Where an axis both layouts keep on a dim
follows, in either, an axis gathered or sliced in before it, no device holds the tile it wants
within its own: XLA moves each device's piece with a collective-permute (besides any gather),
where a plain gather or a local slice would do otherwise.
"""
from __future__ import annotations

import math
from typing import Mapping

from automap.factors import Axes
from automap.shardings import Spec


def tile_permute(actual: Spec, wanted: Spec, nbytes: int, sizes: Mapping[str, int]) -> tuple[Axes, int] | None:
    """(axes, bytes per device) of the collective-permute XLA adds to reshard a value of ``nbytes``
    from ``actual`` to ``wanted``, None where none is needed: the axes of the dims whose tiles the
    two order differently (in mesh order), the smaller of the two pieces a device holds. Measured
    on jax 0.10.2, mesh 2x4, a [32, 128] array resharded along its columns: ('data', 'model') to
    'model' a permute of 2,048 B and a gather over data (4,096 B sent, where a plain gather sends
    2,048); 'model' to ('data', 'model'), ('model', 'data') to 'data' and ('data', 'model') to
    ('model', 'data') a permute of the 2,048 B piece (none where a local slice or a plain gather
    does); a (64, 32) embedding table on ('data', 'model') gathered over data to 'model'.

    >>> sizes = {"data": 2, "model": 4}
    >>> tile_permute(((), ("data", "model")), ((), ("model",)), 16384, sizes)
    (('data', 'model'), 2048)
    >>> tile_permute(((), ("model", "data")), ((), ("model",)), 16384, sizes) is None  # a plain gather
    True
    """
    axes: list[str] = []
    for have, want in zip(actual, wanted, strict=True):
        kept = [a for a in have if a in want]
        if kept != list(have[: len(kept)]) or kept != list(want[: len(kept)]):
            axes += [a for a in (*have, *want) if a not in axes]
    if not axes:
        return None
    pieces = [math.prod(sizes[a] for dim in spec for a in dim) for spec in (actual, wanted)]
    return tuple(a for a in sizes if a in axes), nbytes // max(pieces)


def disjoint_retile(actual: Spec, wanted: Spec, nbytes: int, sizes: Mapping[str, int], in_groups: bool = True) -> tuple | None:
    """((kind, axes, bytes per device[, devices per group]), ...) of XLA's partitioner resharding a
    value of ``nbytes`` from ``actual`` to ``wanted`` where the two differ on one dim alone, split
    there over disjoint axes: where each wanted tile lies within one held tile (the wanted ways a
    multiple of the held ones), one collective-permute of the wanted piece, where a gather of the
    held axes and a slice would send twice its bytes or more; the other way (each held tile within
    a wanted one), a permute of the held piece, then a gather in groups of the held ways over the
    wanted ones (not where ``in_groups`` is false); None otherwise. Measured on jax 0.10.2, meshes 2x4 and 4x2, the operand of a dot
    run in its result's layout (``bd,hd->bh`` and ``bsd,bsh->dh``, the operand split on 'data' (2)
    and the result on 'model' (4), or on 'model' (2) and 'data' (4)): one permute of the wanted
    piece; and a dot's result so moved after its sum (``bsd,bsh->dh`` on 4x2, ``dh`` computed on
    'model' and wanted on 'data': :mod:`automap.output_free_splits`; the estimate gathered 'model',
    0.94x XLA's bytes sent in ``benchmarks/layout_matrix.py``). The other way: a weight gradient
    ``bsc,bso->co`` whose cotangent's ``c`` is on 'data' (4) and the gradient's on 'model' (2)
    (and 2x4 the other way round; the held-out nnx BatchNorm probe's ``down`` layer under FSDP),
    the cotangent permuted (4 KiB) and gathered in pairs, 9,728 B sent where the estimate gathered
    it whole (13,824), and a sum's result on 'model' (4) wanted on 'data' (2). A dense layer's
    forward (``bsh,hd->bsd``, ``h``'s sum on 'model', ``k``'s rows on 'data' and its features on
    'model') XLA runs otherwise, gathering ``h`` whole for the groups of its features
    (:func:`automap.whole_gathers.grouped_partner`, which :func:`automap.analysis.reshards` asks).

    >>> sizes = {"data": 2, "model": 4}
    >>> disjoint_retile((("data",), ()), (("model",), ()), 16384, sizes)
    (('collective-permute', ('data', 'model'), 4096),)
    >>> disjoint_retile((("model",), ()), (("data",), ()), 16384, sizes)  # the held 4 KiB moved, pairs gathered
    (('collective-permute', ('data', 'model'), 4096), ('all-gather', ('model',), 8192, 2))
    """
    differ = [d for d, (have, want) in enumerate(zip(actual, wanted, strict=True)) if tuple(have) != tuple(want)]
    if len(differ) != 1:
        return None
    have, want = actual[differ[0]], wanted[differ[0]]
    if not have or not want or set(have) & set(want):
        return None
    n, m = (math.prod(sizes[a] for a in axes) for axes in (have, want))
    kept = math.prod(sizes[a] for dim in wanted for a in dim)
    axes = tuple(a for a in sizes if a in have or a in want)
    if m % n == 0:
        return (("collective-permute", axes, nbytes // kept),)
    if n % m == 0 and in_groups:  # the held piece moved, then gathered in groups of n / m
        held = math.prod(sizes[a] for dim in actual for a in dim)
        return (("collective-permute", axes, nbytes // held), ("all-gather", tuple(have), nbytes // kept, n // m))
    return None


def displaced_axes(actual: Spec, wanted: Spec, nbytes: int, sizes: Mapping[str, int]) -> tuple | None:
    """((kind, axes, bytes per device[, devices per group]), ...) of XLA's partitioner resharding a
    value of ``nbytes`` whose axes ``A`` leave one dim for another that holds nothing, axes ``N``
    the value does not hold taking their place (('model', -) to ('data', 'model')); None for any
    other pair. It slices over ``N`` first, then moves each device's wanted piece: one
    collective-permute where ``A`` splits no more ways than ``N`` (a wanted tile within one held
    tile), and where it does, an all-to-all in groups of ``|A| / |N|`` before the permute if ``A``
    goes to a minor dim (to a major one: one all-to-all over ``A``, as the estimate prices any
    move). Measured on jax 0.10.2, a (32, 128) array on meshes 2x4 and 4x2: ('model', -) to
    ('data', 'model') on 2x4 and ('data', -) to ('model', 'data') on 4x2 an all-to-all of the 2 KiB
    piece in groups of 2 and a permute of it (2,560 B sent; one all-to-all over 'model', 768 B, to
    the estimate before); the other mesh each a permute of the 2 KiB piece.

    >>> displaced_axes((("model",), ()), (("data",), ("model",)), 16384, {"data": 2, "model": 4})
    (('all-to-all', ('model',), 2048, 2), ('collective-permute', ('data', 'model'), 2048))
    >>> displaced_axes((("model",), ()), (("data",), ("model",)), 16384, {"data": 4, "model": 2})
    (('collective-permute', ('data', 'model'), 2048),)
    """
    held = {a for dim in actual for a in dim}
    for i, j in _two_dims(actual, wanted):
        left, new = tuple(actual[i]), tuple(wanted[i])
        if left and new and not actual[j] and tuple(wanted[j]) == left and not held & set(new):
            break
    else:
        return None
    a, n = (math.prod(sizes[x] for x in axes) for axes in (left, new))
    piece = nbytes // math.prod(sizes[x] for dim in wanted for x in dim)
    permute = ("collective-permute", tuple(x for x in sizes if x in left or x in new), piece)
    if n % a == 0:
        return (permute,)
    if a % n or j < i:
        return None
    return (("all-to-all", left, piece, a // n), permute)


def full_rematerialization(actual: Spec, wanted: Spec, nbytes: int, sizes: Mapping[str, int]) -> tuple | None:
    """((kind, axes, bytes per device),) of XLA's partitioner resharding a value of ``nbytes`` split
    over every device both ways, its axes moved between dims, where it has no all-to-all for the
    move: the dims that change do not split the same numbers of ways before and after (in some
    order), and the move is no merge of one dim's axes into another's (nor the split of a dim into
    two). It warns of an "involuntary full rematerialization", gathers the value whole and slices it:
    one all-gather's bytes sent (in one or two steps). None for any other pair. Measured on jax
    0.10.2, mesh 2x4: (8, 4, 8, 17) from ((), 'data', 'model', ()) or ((), 'model', 'data', ()) to
    (('data', 'model'), ...) and the reverse, (8, 16, 8) from ('data', (), 'model') to ((), ('data',
    'model'), ()): gathered whole (an attention's gradient going from heads to its batch, the held-out
    ViT's 17 tokens dividing nothing; the estimate moved it by one all-to-all, 1/64 of XLA's bytes
    sent). ('data', 'model') to (('data', 'model'), ()) and back, ('data', 'model', ()) to ((),
    'model', 'data'): one all-to-all, as the estimate prices any move.

    >>> sizes = {"data": 2, "model": 4}
    >>> full_rematerialization(((), ("data",), ("model",), ()), (("data", "model"), (), (), ()), 17408, sizes)
    (('all-gather', ('data', 'model'), 17408),)
    >>> print(full_rematerialization((("data",), ("model",)), (("data", "model"), ()), 512, sizes))  # a merge
    None
    """
    held = [a for dim in actual for a in dim]
    if sorted(held) != sorted(a for dim in wanted for a in dim) or math.prod(sizes[a] for a in held) != math.prod(sizes.values()):
        return None
    differ = [d for d, (have, want) in enumerate(zip(actual, wanted, strict=True)) if tuple(have) != tuple(want)]
    ways = [sorted(math.prod(sizes[a] for a in spec[d]) for d in differ) for spec in (actual, wanted)]
    if len(differ) < 2 or ways[0] == ways[1] or _merged(actual, wanted, differ) or _merged(wanted, actual, differ):
        return None
    return (("all-gather", tuple(a for a in sizes if a in held), nbytes),)


def _merged(short: Spec, long: Spec, differ: list[int]) -> bool:
    """Whether ``long`` holds on one dim of ``differ`` its axes in ``short`` followed by the axes
    ``short`` holds on the other (which ``long`` leaves whole): a merge, read one way; a split, the other."""
    if len(differ) != 2:
        return False
    return any(short[i] and not long[j] and tuple(long[i]) == tuple(short[i]) + tuple(short[j])
               for i, j in (differ, differ[::-1]))


def chained_moves(actual: Spec, wanted: Spec, nbytes: int, sizes: Mapping[str, int]) -> tuple | None:
    """((kind, axes, bytes per device), ...) of XLA's partitioner moving a value's axes between its
    dims (no axis gathered) where a dim both gives up an axis and takes another: one all-to-all per
    (source dim, target dim) pair, in turn, each of the whole piece; where the dims given up and
    the dims taken are apart, one all-to-all moves every axis at once (as the estimate prices any
    move: None). Measured on jax 0.10.2, mesh 2x4: (8, 16, 8) and (16, 16, 16) from ('data',
    'model', ()) to ((), 'data', 'model') and back, and from ('model', 'data', ()) to ((), 'model',
    'data'): an all-to-all over 'model' and one over 'data' (the estimate's one over both sent 1/4
    of XLA's bytes); (8, 16, 8, 8) from ('data', 'model', (), ()) to ((), (), 'data', 'model'): one.

    >>> chained_moves((("data",), ("model",), ()), ((), ("data",), ("model",)), 512, {"data": 2, "model": 4})
    (('all-to-all', ('data',), 64), ('all-to-all', ('model',), 64))
    >>> print(chained_moves((("data",), ("model",), (), ()), ((), (), ("data",), ("model",)), 512, {"data": 2, "model": 4}))
    None
    """
    source = {a: d for d, axes in enumerate(actual) for a in axes}
    target = {a: d for d, axes in enumerate(wanted) for a in axes}
    if source.keys() != target.keys():
        return None
    moved = [a for a in source if source[a] != target[a]]
    if not {source[a] for a in moved} & {target[a] for a in moved}:
        return None
    per_device = nbytes // math.prod(sizes[a] for a in source)
    pairs: dict[tuple[int, int], list[str]] = {}
    for a in moved:
        pairs.setdefault((source[a], target[a]), []).append(a)
    return tuple(("all-to-all", tuple(axes), per_device) for _, axes in sorted(pairs.items()))


def joined_axes(actual: Spec, wanted: Spec, nbytes: int, sizes: Mapping[str, int]) -> tuple | None:
    """((kind, axes, bytes per device), ...) of XLA's partitioner resharding a value of ``nbytes``
    whose axes ``A`` leave one dim for another that holds nothing, axes ``N`` the value does not
    hold joining them there ((-, 'data') to (('data', 'model'), -)); None for any other pair. It
    slices over ``N`` first, then moves the wanted piece by one all-to-all over ``A`` (which lands
    minor to ``N``), and permutes it where the dim wants ``A`` before ``N``. Measured on jax 0.10.2,
    an (8, 4, 17, 17) array: (-, 'data') to (('data', 'model'), ...) on 2x4, (-, 'model') to
    (('model', 'data'), ...) and (-, ('data', 'a')) to (('data', 'a', 'b'), ...) on 2x2x2, an
    all-to-all and a permute of the piece (an attention's probabilities going from its heads to
    its batch, the held-out ViT's ``manual_fsdp``: the estimate moved the held piece, 0.32x XLA's
    bytes sent); (-, 'model') to (('data', 'model'), ...) the all-to-all alone.

    >>> joined_axes(((), ("data",)), (("data", "model"), ()), 36992, {"data": 2, "model": 4})
    (('all-to-all', ('data',), 4624), ('collective-permute', ('data', 'model'), 4624))
    >>> joined_axes(((), ("model",)), (("data", "model"), ()), 36992, {"data": 2, "model": 4})
    (('all-to-all', ('model',), 4624),)
    """
    held = {a for dim in actual for a in dim}
    for i, j in _two_dims(actual, wanted):
        left, target = tuple(actual[i]), tuple(wanted[j])
        new = tuple(a for a in target if a not in left)
        if left and not wanted[i] and not actual[j] and new and not held & set(new) \
                and tuple(a for a in target if a in left) == left and len(new) + len(left) == len(target):
            break
    else:
        return None
    piece = nbytes // math.prod(sizes[x] for dim in wanted for x in dim)
    moved = (("all-to-all", left, piece),)
    if target == new + left:
        return moved
    return moved + (("collective-permute", tuple(x for x in sizes if x in target), piece),)


def _two_dims(actual: Spec, wanted: Spec) -> tuple[tuple[int, int], ...]:
    """The two dims ``actual`` and ``wanted`` differ on, both ways round; () where they differ on
    some other number of dims."""
    differ = [d for d, (have, want) in enumerate(zip(actual, wanted, strict=True)) if tuple(have) != tuple(want)]
    return (tuple(differ), tuple(differ[::-1])) if len(differ) == 2 else ()
