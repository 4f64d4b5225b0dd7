"""Structure the tactics recognise: which values derive from the weights, and where a factor
goes when it flows forward from a value through the ops' factor rules.

Nothing here looks at names: a *weight* is an input the step returns updated (state) or a value
computed from such inputs alone; a factor's *fate* is read off the factor rules of the ops it
flows through (a contraction with a weight, a reduction, a blocked dim, the loss).
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Literal

from automap.ir.program import Op, Program
from automap.rules import traits_of

EndKind = Literal["contract_weight", "contract_activation", "reduce", "blocked", "mix_weight", "output"]


def producers(program: Program) -> dict[int, Op]:
    out = {}
    for op in program.all_ops:
        for v in op.linked_outputs:
            out.setdefault(v, op)
    return out


def weight_derived(program: Program, state_inputs: Iterable[int]) -> set[int]:
    """Values computed from state inputs (and constants) alone, with at least one state input:
    the weights as the forward pass sees them (sliced out of a scan, reshaped, transposed)."""
    return derived(program, state_inputs)[0]


def derived(program: Program, state_inputs: Iterable[int]) -> tuple[set[int], set[int]]:
    """(weight-derived values, constant values: literals, consts and what is computed from them)."""
    known = set(state_inputs)
    constant = {v.id for v in program.values if v.kind in ("literal", "const")}
    changed = True
    while changed:
        changed = False
        for op in program.all_ops:
            if op.regions:
                back = op.loop_backedges()
                for outer, region in region_links(op):
                    # a loop carry is one only when its initial value and what the body feeds back both are
                    # (an RNN's zero initial state is a constant, the carry the body updates from the data is not)
                    for s in (known, constant):
                        if outer in s and region not in s and back.get(region, outer) in s:
                            s.add(region)
                            changed = True
                continue
            if op.phase != "forward" or all(v in known or v in constant for v in op.outputs):
                continue
            if all(v in known or v in constant for v in op.inputs):
                (known if any(v in known for v in op.inputs) else constant).update(op.outputs)
                changed = True
    return known, constant


def region_links(op: Op) -> list[tuple[int, int]]:
    """(outer operand, region input) pairs of a control-flow op (see ``automap.ir.lower``)."""
    if op.primitive == "scan":
        return list(zip(op.inputs, op.regions[0].inputs, strict=True))
    if op.primitive == "cond":
        return [(o, r.inputs[i]) for r in op.regions for i, o in enumerate(op.inputs[1:])]
    if op.primitive == "while":
        cond, body = op.regions
        cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
        carries = op.inputs[cn + bn:]
        pairs = list(zip(op.inputs[:cn], cond.inputs[:cn], strict=True))
        pairs += list(zip(op.inputs[cn:cn + bn], body.inputs[:bn], strict=True))
        pairs += list(zip(carries, cond.inputs[cn:], strict=True)) + list(zip(carries, body.inputs[bn:], strict=True))
        return pairs
    return []


@dataclasses.dataclass(frozen=True)
class FactorEnd:
    kind: EndKind
    op: Op | None  # where the flow ended (None for a program output)


@dataclasses.dataclass(frozen=True)
class Flow:
    """Where one dim of one value goes, followed forward through the program."""

    ends: tuple[FactorEnd, ...]
    visited: frozenset[tuple[int, int]]  # (value, dim) pairs the factor reached

    def kinds(self) -> set[str]:
        return {e.kind for e in self.ends}

    def ops(self, kind: EndKind) -> list[Op]:
        return [e.op for e in self.ends if e.kind == kind and e.op is not None]


def follow(
    program: Program, value: int, dim: int, weights: set[int], *, phases: tuple[str, ...] = ("forward",),
    users: dict[int, list[tuple[Op, int]]] | None = None, weight_dims: frozenset[tuple[int, int]] | None = None,
    contractions: frozenset[str] = frozenset({"matmul"}),
) -> Flow:
    """Follow dim ``dim`` of ``value`` forward: through every op reading it, the factor of that dim
    goes to the result dims holding it, until it is contracted, reduced, blocked, meets a weight
    in an elementwise op (``mix_weight``) or reaches a program output. With ``weight_dims`` (the
    (value, dim) pairs a weight's own dims reach), a weight met on a dim a broadcast made (a bias
    broadcast to its layer's output shape before the add, as haiku's ``Linear`` does) is no
    ``mix_weight``: that dim holds no factor of the weight. ``contractions``: the kinds of
    contraction (:class:`automap.rules.traits.Contraction`) whose summed dims end a flow as a
    contraction; any other summed dim ends it as a ``reduce`` (megatron adds ``"convolution"``:
    a conv's input features are a row-parallel split, as a dot's contracted dim is)."""
    users = users if users is not None else consumers(program)
    outputs = set(program.outputs)
    ends: list[FactorEnd] = []
    seen: set[tuple[int, int]] = set()
    stack = [(value, dim)]
    while stack:
        vid, d = stack.pop()
        if (vid, d) in seen:
            continue
        seen.add((vid, d))
        if vid in outputs:
            ends.append(FactorEnd("output", None))
        for op, pos in users.get(vid, ()):
            if op.phase not in phases and not op.regions:
                continue
            rule = op.rule
            dims = rule.operands[pos]
            if d >= len(dims) or not dims[d]:
                ends.append(FactorEnd("blocked", op))
                continue
            f = dims[d][0]  # the major factor of the dim carries the tiling
            factor = rule.factors[f]
            if factor.kind == "blocked":
                ends.append(FactorEnd("blocked", op))
                continue
            if factor.kind == "reduction":
                traits = traits_of(op.primitive)
                if traits.contraction is not None and traits.contraction.kind in contractions:
                    # the operands contracted with this one (a ragged dot's group sizes are not)
                    others = [v for i, v in enumerate(op.linked_inputs)
                              if i != pos and any(f in fs for fs in rule.operands[i])]
                    kind: EndKind = "contract_weight" if all(v in weights for v in others) else "contract_activation"
                    ends.append(FactorEnd(kind, op))
                else:
                    ends.append(FactorEnd("reduce", op))
                continue
            if not op.regions:
                partners = [
                    v for i, (v, vd) in enumerate(zip(op.linked_inputs, rule.operands, strict=True))
                    if i != pos and v in weights and any(
                        fs and fs[0] == f and (weight_dims is None or (v, wd) in weight_dims) for wd, fs in enumerate(vd))
                ]
                if partners:  # recorded, and followed on: a bias add keeps a column factor going
                    ends.append(FactorEnd("mix_weight", op))
            for v, vd in zip(op.linked_outputs, rule.results, strict=True):
                for rd, fs in enumerate(vd):
                    if fs and fs[0] == f:
                        stack.append((v, rd))
                    elif f in fs:  # merged into a dim behind a major factor: a tiling cannot follow
                        ends.append(FactorEnd("blocked", op))
    return Flow(tuple(ends), frozenset(seen))


def consumers(program: Program) -> dict[int, list[tuple[Op, int]]]:
    """value -> (op, operand position) for every op that reads it through its rule (memoised)."""
    got = program.memo.get("consumers")
    if got is None:
        got = program.memo["consumers"] = {}
        for op in program.all_ops:
            for pos, v in enumerate(op.linked_inputs):
                got.setdefault(v, []).append((op, pos))
    return got
