"""What activation recomputation (:mod:`automap.ir.recompute`) may recompute: the repeated
blocks of a forward (numbered layers, :func:`repeated_blocks`; layers found by structure,
:func:`structural_blocks`; the uses of one shared layer, :func:`~automap.ir.shared_layers.shared_layers`),
or, in a model without any, the segments of its forward (:func:`recompute_units`).
"""
from __future__ import annotations

import re
from typing import Sequence

from automap.ir.program import Op, Program
from automap.ir.scan_recompute import scan_blocks
from automap.ir.segments import PREFIX, forward_segments
from automap.ir.shared_layers import shared_layers

__all__ = ["block_ops", "numbered_alike", "recompute_units", "repeated_blocks", "structural_blocks", "weights_between"]

_NUMBERED = re.compile(r"^(.*?)_?(\d+)$")


def repeated_blocks(program: Program, min_repeats: int = 2) -> tuple[str, ...]:
    """Module paths of repeated blocks, in forward order: a path whose last part is numbered
    (``blocks_0``, ``layer3``) with at least ``min_repeats`` numbered siblings of the same stem
    (``GPT/blocks_0``, ``GPT/blocks_1``), not inside another such block, and forward ops under
    it that can be recomputed; first, each scanned stack of layers
    (:func:`~automap.ir.scan_recompute.scan_blocks`, named by its body's module path: a path so
    named is that scan's, not a block of its own). Where neither numbered names nor alike
    parameters (:func:`structural_blocks`) give layers, the applications of one layer whose
    parameters are shared (:func:`~automap.ir.shared_layers.shared_layers`: ALBERT).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> def f(x):
    ...     for i in range(2):
    ...         with jax.named_scope(f"layer_{i}"):
    ...             x = jnp.sin(x)
    ...     return x
    >>> repeated_blocks(lower(jax.make_jaxpr(f)(jnp.ones(3)), ["x"], ["y"]))
    ('layer_0', 'layer_1')
    """
    seen: dict[str, None] = {}
    for op in program.ops:
        if op.phase != "forward" or not op.name:
            continue
        parts = op.name.split("/")
        for i, part in enumerate(parts):
            if _NUMBERED.match(part):
                seen.setdefault("/".join(parts[: i + 1]), None)
    stems: dict[tuple[str, str], list[str]] = {}
    for path in seen:
        parent, _, last = path.rpartition("/")
        stems.setdefault((parent, _NUMBERED.match(last).group(1)), []).append(path)  # type: ignore[union-attr]
    out = [p for group in stems.values() if len(group) >= min_repeats for p in group]
    outer = {p for p in out if not any(p.startswith(q + "/") for q in out)}  # ln1/ln2 inside blocks_0: one block
    scanned = tuple(scan_blocks(program))  # a scanned stack of layers: one block, its body
    named = tuple(p for p in seen if p in outer and p not in scanned and block_ops(program, p))
    layers = ()
    # norm0, q0, ..., norm1, q1 (the parts of layers a loop left unnamed); ln1, attention, ln2 (one layer's norms)
    if not named or numbered_alike(named) or weights_between(program, named):
        layers = tuple(b for b in structural_blocks(program, min_repeats) if block_ops(program, b))
    if not layers and not named:  # one layer applied again and again, its parameters shared (ALBERT)
        layers = tuple(b for b in shared_layers(program, min_repeats) if block_ops(program, b))
    return scanned + (layers or named)


def numbered_alike(blocks: Sequence[str]) -> bool:
    """Whether ``blocks`` are the parts of layers rather than layers: two or more stems under one
    parent numbered alike (``norm0``, ``q0``, ``o0``, ``norm1``, ``q1``, ``o1``: a loop naming its
    modules by its index, the attention between them under no module). Recomputing such a part
    saves next to nothing (held-out ``attention_sdpa`` under FSDP, all 16 recomputed: 299,552 ->
    289,216 B by XLA's measure); the layers :func:`structural_blocks` finds hold the attention too
    (the first re-gathered: 238,192 B).

    >>> numbered_alike(["M/norm0", "M/q0", "M/norm1", "M/q1"]), numbered_alike(["GPT/blocks_0", "GPT/blocks_1"])
    (True, False)
    """
    numbers: dict[tuple[str, str], set[str]] = {}
    for path in blocks:
        parent, _, last = path.rpartition("/")
        stem, n = _NUMBERED.match(last).groups()  # type: ignore[union-attr]
        numbers.setdefault((parent, stem), set()).add(n)
    by_parent: dict[tuple[str, frozenset[str]], int] = {}
    for (parent, _), ns in numbers.items():
        by_parent[(parent, frozenset(ns))] = by_parent.get((parent, frozenset(ns)), 0) + 1
    return any(k >= 2 for k in by_parent.values())


def weights_between(program: Program, blocks: Sequence[str]) -> bool:
    """Whether ``blocks`` are the parts of a layer rather than layers: between two numbered
    siblings of one stem (``ln1``, ``ln2``), a forward op under none of them reads a weight (an
    input of two or more dims): a pre-norm layer's two norms, the attention between them under a
    scope of its own (held-out ``hk_transformer``: ``ln1``, ``attn``, ``ln2``, ``mlp``). Consecutive
    layers (``blocks_0``, ``blocks_1``) leave nothing between them. The layers
    :func:`structural_blocks` finds hold the attention (hk_transformer under issue 21's budget of
    103,232 B: every norm and MLP linear recomputed, XLA 120,856 B; ``state/params/ln1``, the
    first norm and the attention, recomputed selectively: 101,292 B).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> def f(w, x):
    ...     with jax.named_scope("ln1"):
    ...         x = jnp.tanh(x)
    ...     x = x @ w
    ...     with jax.named_scope("ln2"):
    ...         return jnp.tanh(x)
    >>> a = jnp.ones((4, 4))
    >>> weights_between(lower(jax.make_jaxpr(f)(a, a), ["w", "x"], ["y"]), ["ln1", "ln2"])
    True
    """
    forward = [op for op in program.ops if op.phase == "forward"]
    stems: dict[tuple[str, str], list[str]] = {}
    for path in blocks:
        parent, _, last = path.rpartition("/")
        stems.setdefault((parent, _NUMBERED.match(last).group(1)), []).append(path)  # type: ignore[union-attr]
    for members in stems.values():
        inside = [any(op.name == m or op.name.startswith(m + "/") for m in members) for op in forward]
        at = [j for j, yes in enumerate(inside) if yes]
        if len(members) > 1 and at and any(
                not inside[j] and any(program.values[v].kind == "input" and program.values[v].ndim >= 2
                                      for v in forward[j].inputs) for j in range(at[0], at[-1])):
            return True
    return False


def structural_blocks(program: Program, min_repeats: int = 2) -> dict[str, tuple[int, ...]]:
    """Layers found by structure, for a model without named scopes: the inputs the forward
    reads, grouped by path with its numbers left out, shape and dtype; the groups with the most
    members (at least ``min_repeats``, one per layer) give each layer's parameters, and layer
    ``i`` is the forward ops from the first read of a layer-``i`` parameter to the first read of
    a layer-``i + 1`` one (the last layer: as many ops as the one before). Named by the common path of the
    layer's parameters (``state/params/layers/0``), or ``layer i``.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> def loss(ws, x):
    ...     for w in ws:
    ...         x = jnp.tanh(x @ w)
    ...     return x.sum()
    >>> a = jnp.ones((4, 4))
    >>> prog = lower(jax.make_jaxpr(jax.grad(loss))([a, a], a), ["ws/0", "ws/1", "x"], ["g/0", "g/1"])
    >>> {name: len(ops) for name, ops in structural_blocks(prog).items()}
    {'ws/0': 3, 'ws/1': 3}
    """
    key = ("structural_blocks", min_repeats)
    if key in program.memo:
        return program.memo[key]
    forward = [(i, op) for i, op in enumerate(program.ops) if op.phase == "forward"]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, op in forward:
        for v in op.inputs:
            if program.values[v].kind == "input":
                first.setdefault(v, i)
                last[v] = i
    alike: dict[tuple, list[int]] = {}  # the same path but for its numbers, shape and dtype: one per layer
    for v in first:
        value = program.values[v]
        alike.setdefault((re.sub(r"\d+", "#", value.name), value.shape, str(value.dtype)), []).append(v)
    groups = [sorted(g, key=first.__getitem__) for g in alike.values() if len(g) >= min_repeats]
    n = max((len(g) for g in groups), default=0)
    layers = [[g[i] for g in groups if len(g) == n] for i in range(n)]
    out: dict[str, tuple[int, ...]] = {}
    starts = [min(first[v] for v in params) for params in layers]
    if n and starts == sorted(starts) and len(set(starts)) == n:
        # the last layer is as long as the one before (identical layers), or ends at its last read
        ends = starts[1:] + [2 * starts[-1] - starts[-2] if n > 1 else max(last[v] for v in layers[-1]) + 1]
        for i, (params, start, end) in enumerate(zip(layers, starts, ends, strict=True)):
            paths = [program.values[v].name.split("/") for v in params]
            common = [p[0] for p in zip(*paths) if len(set(p)) == 1]
            name = "/".join(common) or f"layer {i}"
            out[name if name not in out else f"layer {i}"] = tuple(op.id for j, op in forward if start <= j < end)
    program.memo[key] = out
    return out


def block_ops(program: Program, block: str) -> list[Op]:
    """The block's forward top-level ops (under the module path ``block``, or the layer of
    :func:`structural_blocks` so named); empty if one sits in a user's remat, or if every one
    holds a region (control flow, whose results :func:`automap.ir.recompute._slice` keeps: nothing to recompute)."""
    if block.startswith(PREFIX):
        ids = forward_segments(program).get(block)
    else:
        ids = (structural_blocks(program).get(block) or shared_layers(program).get(block)
               if block not in _paths(program) else None)
    if ids is not None:
        ids = set(ids)
        ops = [op for op in program.ops if op.id in ids]
    else:
        ops = [op for op in program.ops
               if op.phase == "forward" and (op.name == block or op.name.startswith(block + "/"))]
    if any(op.remat for op in ops) or all(op.regions for op in ops):
        return []
    return ops


def recompute_units(program: Program) -> tuple[str, ...]:
    """What the search may recompute: the repeated blocks (:func:`repeated_blocks`), or, in a
    model without any, the segments of its forward (:func:`~automap.ir.segments.forward_segments`)
    that can be recomputed.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> def loss(w1, w2, x):  # two layers of distinct shapes: no repeated block
    ...     return jnp.sin(jnp.tanh(x @ w1) @ w2).sum()
    >>> prog = lower(jax.make_jaxpr(jax.grad(loss, (0, 1)))(jnp.ones((4, 8)), jnp.ones((8, 2)), jnp.ones((3, 4))),
    ...              ["w1", "w2", "x"], ["g1", "g2"])
    >>> recompute_units(prog)  # the first segment is named after the first 2-d input read, here the batch
    ('forward from x', 'forward from w2')
    """
    return repeated_blocks(program) or tuple(s for s in forward_segments(program) if block_ops(program, s))


def _paths(program: Program) -> frozenset[str]:
    """Every module path of a forward op and its prefixes."""
    got = program.memo.get("module_paths")
    if got is None:
        parts = {tuple(op.name.split("/")) for op in program.ops if op.phase == "forward" and op.name}
        got = program.memo["module_paths"] = frozenset("/".join(p[:i + 1]) for p in parts for i in range(len(p)))
    return got
