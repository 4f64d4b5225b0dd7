"""Walks over a parsed HLO module's call graph (:mod:`automap.hlo`): how many times each
computation runs, and whether an instruction may depend on one of some opcodes across calls and loops."""
from __future__ import annotations

from automap.hlo import Instruction, Module, callees

__all__ = ["execution_counts", "depends_on"]


def execution_counts(module: Module) -> tuple[dict[str, int], list[str]]:
    """How many times each computation reachable from ENTRY runs, and warnings.

    Counts multiply along nested calls and add over call sites; a while without a known trip
    count is counted once (with a warning).
    """
    order, seen, warnings = [], set(), []

    def visit(name: str) -> None:  # post-order over the (acyclic) call graph
        if name in seen or name not in module.computations:
            return
        seen.add(name)
        for inst in module.computations[name].instructions.values():
            for callee, _, _ in callees(inst):
                visit(callee)
        order.append(name)

    if module.entry is None:
        return {}, warnings
    visit(module.entry)
    counts = dict.fromkeys(order, 0)
    counts[module.entry] = 1
    for name in reversed(order):
        for inst in module.computations[name].instructions.values():
            for callee, role, times in callees(inst):
                if callee not in counts:
                    continue
                if times is None:
                    times = 1
                    if role == "body":
                        warnings.append(f"while {inst.name!r} in {name!r} has no known_trip_count;"
                                        " its body is counted once")
                counts[callee] += counts[name] * times
    return counts, warnings


def depends_on(module: Module, comp: str, name: str, opcodes: frozenset[str]) -> bool:
    """Whether instruction `name` of `comp` may depend on an instruction with one of `opcodes`.

    Follows operands, fusion/call parameters to the caller's operands, and while-loop tuple
    elements to the loop's init and body root; an over-approximation.
    """
    seen: set[tuple[str, str]] = set()

    def element(c: str, n: str, index: int) -> bool:
        inst = module.computations[c].instructions.get(n)
        if inst is not None and inst.opcode == "tuple" and index < len(inst.operands):
            return visit(c, inst.operands[index])
        return visit(c, n)

    def from_parameter(c: str, inst: Instruction, index: int | None) -> bool:
        for caller, call, role in module.callers.get(c, []):
            if role in ("body", "condition"):
                body = module.computations.get(call.attrs["body"].lstrip("%"))
                sources = [(caller, call.operands[0])]
                if body is not None and body.root is not None:
                    sources.append((body.name, body.root.name))
                for src_comp, src in sources:
                    if element(src_comp, src, index) if index is not None else visit(src_comp, src):
                        return True
            elif role == "branch" or inst.parameter_number is None:
                if any(visit(caller, o) for o in call.operands):
                    return True
            elif inst.parameter_number < len(call.operands):
                if visit(caller, call.operands[inst.parameter_number]):
                    return True
        return False

    def visit(c: str, n: str) -> bool:
        if (c, n) in seen or c not in module.computations:
            return False
        seen.add((c, n))
        inst = module.computations[c].instructions.get(n)
        if inst is None:
            return False
        if inst.opcode in opcodes:
            return True
        if inst.opcode == "parameter":
            return from_parameter(c, inst, None)
        if inst.opcode == "get-tuple-element" and inst.operands:
            src = module.computations[c].instructions.get(inst.operands[0])
            index = int(inst.attrs.get("index", "0"))
            if src is not None and src.opcode == "parameter":
                return from_parameter(c, src, index)
            return element(c, inst.operands[0], index)
        return any(visit(c, o) for o in inst.operands)

    return visit(comp, name)
