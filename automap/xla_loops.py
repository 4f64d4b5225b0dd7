"""A loop as Shardy sees it, for :mod:`automap.xla_layout`: its links split into ties and edges.

automap's IR links a ``scan``/``while`` op's operands and results to its body's inputs and outputs
by one op (:func:`automap.ir.lower.link_rule`). XLA hands Shardy a ``while`` whose loop-invariant
operands (a scan's constants and scanned inputs) the body reads as free variables: the same value
inside and out. Its carries (and the buffers a scan stacks its outputs into) are data-flow edges:
``sdy-add-data-flow-edges`` puts one ``sdy.data_flow_edge`` op after the ``while`` per result, whose
sharding is the result's and the body input's (the owner's), and whose sources are the init and
the value the body yields. The edge op is taken in its place in the module, after the body's ops,
and again when its owner changes, not when a source does: where the init gets its layout in the
same round as the body's ops give the body input theirs, the body's wins, and the init is resharded
at the loop's entry. Measured (jaxlib's ``sdy-op-priority-propagate`` with
``debug-propagation-edge-sharding`` on the module XLA dumps before propagation: with
``XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_pass_re=shardy-xla``, ``DIR/shardy/<module>/01.before_propagation.mlir``,
run by ``jaxlib.mlir.passmanager`` as ``sdy-add-data-flow-edges,sdy-op-priority-propagate{...}`` in
JAX's MLIR context, the verifier off; without the first pass a ``while`` is not propagated as XLA
propagates it, and ``02.after_propagation.mlir`` is XLA's own result): the corpus
gpt_linen_scan's ``manual_fsdp`` inputs-only program gives its forward init (the embedding, a
gather) the batch over ('data', 'model') in the third round (step 491), and the body's residual add
gives the body input d_model over ('data', 'model') from the attention projection five steps later
(step 496), before the edge is taken: XLA carries d_model. Where the init's layout arrives in an
earlier round than the body's, the edge is taken in that round and the init's wins.

:func:`loop_links` gives, per loop op, the ops standing for its links (:class:`Link`): a *tie*
per invariant operand (taken where the loop op is, as any op, both ways; a scanned input's tie as
a ``dynamic_slice``: forward first) and an *edge* per carry (taken after the body; owners: the body
inputs and the result; sources: the init and the yielded value), a stacked output's tie taken after
the body as a ``dynamic_update_slice``.

A ``cond`` is taken the same way (XLA hands Shardy a ``stablehlo.case``, whose branches read its
operands as free variables and whose results are data-flow edges, the sources the values each
branch returns): a tie per operand to the branches' inputs, taken before the branches' ops, and an
edge per result after them. Taken as one op tying operands to branch inputs, a cond moved axes only
from the round of parallel factors: a weight gradient read only by a cond's branches (novograd's,
``optax.MultiSteps``' updates) took a dot's layout there, where the branches' elementwise ops give
it the weight's in the first rounds (0.80x XLA's bytes sent under FSDP).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from automap.ir.program import Op, Program
from automap.rules.registry import FactorRule

__all__ = ["Link", "loop_links", "LINKED", "share_owners", "with_loop_links"]

# ops taken as their links: loops, and conds (``stablehlo.case``: its branches read their operands
# as free variables, the same values inside and out; its results are data-flow edges whose sources
# are the values each branch returns)
LINKED = ("scan", "while", "cond")


@dataclasses.dataclass(frozen=True, eq=False)
class Link:
    """One tie or edge of a loop, an op to :mod:`automap.xla_layout` (``primitive``: how it
    propagates; ``owners``: the values whose change re-takes an edge, all of ``linked`` for a tie)."""

    id: int
    primitive: str
    rule: FactorRule
    linked_inputs: tuple[int, ...]
    linked_outputs: tuple[int, ...]
    owners: frozenset[int]
    after_body: bool

    @property
    def linked(self) -> tuple[int, ...]:
        return self.linked_inputs + self.linked_outputs


def loop_links(op: Op, first_id: int) -> list[Link]:
    """``op``'s ties and edges (module docstring), numbered from ``first_id`` down.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> f = lambda w, xs: jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), h), xs[0], xs)
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((3, 4))), ["w", "xs"], ["h", "hs"])
    >>> (scan,) = [op for op in prog.ops if op.primitive == "scan"]
    >>> [(link.primitive, link.after_body) for link in loop_links(scan, -1)]  # w, xs; the carry h; hs
    [('loop_tie', False), ('dynamic_slice', False), ('loop_edge', True), ('dynamic_update_slice', True)]
    """
    dims = dict(zip(op.linked_inputs, op.rule.operands)) | dict(zip(op.linked_outputs, op.rule.results))
    ties: list[tuple[str, tuple[int, ...], tuple[int, ...], bool]] = []  # (primitive, sources, owners, after)
    ins, outs, p = op.inputs, op.outputs, op.params
    if op.primitive == "scan":
        (body,) = op.regions
        nc, nk = p["num_consts"], p["num_carry"]
        ties += [("loop_tie", (ins[i],), (body.inputs[i],), False) for i in range(nc)]
        ties += [("dynamic_slice", (ins[k],), (body.inputs[k],), False) for k in range(nc + nk, len(ins))]
        ties += [("loop_edge", (ins[nc + j], body.outputs[j]), (body.inputs[nc + j], outs[j]), True) for j in range(nk)]
        ties += [("dynamic_update_slice", (body.outputs[m],), (outs[m],), True) for m in range(nk, len(outs))]
    elif op.primitive == "cond":  # operand 0, the branch index, links nothing
        ties += [("loop_tie", (ins[i],), tuple(r.inputs[i - 1] for r in op.regions), False) for i in range(1, len(ins))]
        ties += [("loop_edge", tuple(r.outputs[j] for r in op.regions), (outs[j],), True) for j in range(len(outs))]
    else:  # while
        cond, body = op.regions
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        ties += [("loop_tie", (ins[i],), (cond.inputs[i],), False) for i in range(cn)]
        ties += [("loop_tie", (ins[cn + i],), (body.inputs[i],), False) for i in range(bn)]
        ties += [("loop_edge", (ins[cn + bn + j], body.outputs[j]), (body.inputs[bn + j], cond.inputs[cn + j], outs[j]),
                  True) for j in range(len(outs))]
    links = []
    for primitive, sources, owners, after in ties:
        rule = _sub_rule(op.rule, [dims[v] for v in sources], [dims[v] for v in owners])
        watched = frozenset(owners) if primitive == "loop_edge" else frozenset(sources + owners)
        links.append(Link(first_id - len(links), primitive, rule, sources, owners, watched, after))
    return links


def with_loop_links(program: Program, order: list[Op]) -> list:
    """``order`` with each loop op replaced by its ties, its body's ops, then its edges
    (module docstring: as the ``sdy.data_flow_edge`` ops follow a ``while``)."""
    out: list = []
    next_id = -1

    def expand(op: Op) -> None:
        nonlocal next_id
        if op.primitive not in LINKED:
            out.append(op)
            for region in op.regions:
                for inner in region.ops:
                    expand(inner)
            return
        links = loop_links(op, next_id)
        next_id -= len(links)
        out.extend(link for link in links if not link.after_body)
        for region in op.regions:
            for inner in region.ops:
                expand(inner)
        out.extend(link for link in links if link.after_body)

    top = {op.id for op in program.ops}
    for op in order:
        if op.id in top:
            expand(op)
    return out


def share_owners(owners: Sequence[int], specs: dict, fixed: frozenset) -> list[int]:
    """Give every owner the spec extending all of theirs (none: where two disagree); returns the
    owners whose spec changed.

    >>> specs = {1: (("data",), ()), 2: (("data",), ("model",))}
    >>> share_owners([1, 2, 3], specs, fixed=frozenset()), specs[1] == specs[3] == specs[2]
    ([1, 3], True)
    >>> share_owners([1, 4], {1: (("data",), ()), 4: (("model",), ())}, fixed=frozenset())  # they disagree
    []
    """
    held = [specs[v] for v in owners if v in specs]
    if not held:
        return []
    widest = max(held, key=lambda spec: sum(map(len, spec)))
    if not all(all(w[: len(a)] == a for w, a in zip(widest, spec)) for spec in held):
        return []
    changed = []
    for v in owners:
        if v not in fixed and specs.get(v) != widest:
            specs[v] = widest
            changed.append(v)
    return changed


def _sub_rule(rule: FactorRule, operands: list, results: list) -> FactorRule:
    """``rule`` restricted to some of its operands and results, its factors renumbered."""
    used: dict[int, int] = {}
    for dims in operands + results:
        for fs in dims:
            for f in fs:
                used.setdefault(f, len(used))
    renumber = lambda dims: tuple(tuple(used[f] for f in fs) for fs in dims)  # noqa: E731
    return FactorRule(tuple(rule.factors[f] for f in used), tuple(renumber(d) for d in operands),
                      tuple(renumber(d) for d in results))
