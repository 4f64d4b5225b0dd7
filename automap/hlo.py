"""A small parser for XLA's HLO text: just enough structure to measure a compiled program.

`parse_module(text)` turns the output of `jax.stages.Compiled.as_text()` (or a hand-written
snippet) into computations of instructions with parsed result shapes, operand names and raw
attribute strings. Lines it does not understand are skipped; an instruction whose result shape
cannot be parsed is kept with `shape=None` so that callers decide whether that is fatal.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator
from typing import Union

import numpy as np

__all__ = [
    "ArrayShape", "TupleShape", "Shape", "Instruction", "Computation", "Module",
    "parse_shape", "parse_module", "replica_groups", "source_target_pairs", "callees",
    "execution_counts", "depends_on", "int_list",
]

# bits per element; sub-byte types are rounded up to whole bytes per buffer
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "f16": 16, "bf16": 16, "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64,
    "c64": 64, "c128": 128, "token": 0, "opaque": 0,
}


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    for prefix, bits in (("f8", 8), ("f6", 6), ("f4", 4)):  # f8e4m3fn, f8e5m2, f4e2m1fn, ...
        if dtype.startswith(prefix):
            return bits
    raise ValueError(f"unknown HLO element type {dtype!r}")


@dataclasses.dataclass(frozen=True)
class ArrayShape:
    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        return -(-self.elements * _bits(self.dtype) // 8)


@dataclasses.dataclass(frozen=True)
class TupleShape:
    parts: tuple[Shape, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


Shape = Union[ArrayShape, TupleShape]

_ARRAY = re.compile(r"\s*([a-z][a-z0-9]*)\[([^\]]*)\](?:\{[^}]*\})?")
_COMMENT = re.compile(r"/\*.*?\*/")


def parse_shape(text: str) -> Shape:
    """Parses an HLO shape such as ``f32[8,16]{1,0}`` or ``(s32[], bf16[4]{0})``.

    >>> parse_shape("(f32[8,16]{1,0}, s8[4])").nbytes
    516
    """
    text = _COMMENT.sub("", text)
    shape, end = _parse_shape_at(text, 0)
    if text[end:].strip():
        raise ValueError(f"trailing text after shape: {text!r}")
    return shape


def _parse_shape_at(text: str, i: int) -> tuple[Shape, int]:
    while i < len(text) and text[i].isspace():
        i += 1
    if text.startswith("(", i):
        parts, i = [], i + 1
        while True:
            while i < len(text) and text[i] in " ,":
                i += 1
            if text.startswith(")", i):
                return TupleShape(tuple(parts)), i + 1
            part, i = _parse_shape_at(text, i)
            parts.append(part)
    m = _ARRAY.match(text, i)
    if not m:
        raise ValueError(f"cannot parse shape at {text[i:i + 40]!r}")
    dims = tuple(int(d.strip().removeprefix("<=")) for d in m.group(2).split(",") if d.strip())
    _bits(m.group(1))
    return ArrayShape(m.group(1), dims), m.end()


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    opcode: str
    shape: Shape | None  # None: the result shape did not parse
    operands: tuple[str, ...]
    operand_shapes: tuple[Shape | None, ...]  # only where the text spells them out
    attrs: dict[str, str]  # raw attribute text, e.g. {"to_apply": "%add", "dimensions": "{0}"}
    line: str
    is_root: bool = False
    parameter_number: int | None = None


@dataclasses.dataclass(frozen=True)
class Computation:
    name: str
    instructions: dict[str, Instruction]  # in program order
    is_entry: bool = False

    @functools.cached_property
    def root(self) -> Instruction | None:
        roots = [i for i in self.instructions.values() if i.is_root]
        return roots[-1] if roots else (list(self.instructions.values()) or [None])[-1]

    @functools.cached_property
    def users(self) -> dict[str, list[Instruction]]:
        out: dict[str, list[Instruction]] = {}
        for inst in self.instructions.values():
            for op in dict.fromkeys(inst.operands):
                out.setdefault(op, []).append(inst)
        return out

    @functools.cached_property
    def parameters(self) -> dict[int, Instruction]:
        return {i.parameter_number: i for i in self.instructions.values()
                if i.opcode == "parameter" and i.parameter_number is not None}


@dataclasses.dataclass(frozen=True)
class Module:
    name: str
    computations: dict[str, Computation]
    entry: str | None
    num_partitions: int | None = None
    replica_count: int | None = None

    @property
    def num_devices(self) -> int | None:
        if self.num_partitions is None and self.replica_count is None:
            return None
        return (self.num_partitions or 1) * (self.replica_count or 1)

    @functools.cached_property
    def callers(self) -> dict[str, list[tuple[str, Instruction, str]]]:
        """callee -> [(caller computation, calling instruction, role)]."""
        out: dict[str, list[tuple[str, Instruction, str]]] = {}
        for comp in self.computations.values():
            for inst in comp.instructions.values():
                for callee, role, _ in callees(inst):
                    out.setdefault(callee, []).append((comp.name, inst, role))
        return out


_INST = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s*\b([a-z][a-z0-9\-]*)\((.*)$")
_HEADER = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+).*\{\s*$")
_NO_OPERANDS = frozenset({"constant", "parameter", "iota", "partition-id", "replica-id",
                          "rng-get-and-update-state", "after-all"})


def parse_module(text: str) -> Module:
    """Parses HLO text (the output of ``jax.stages.Compiled.as_text()``) into a `Module`.

    >>> m = parse_module('''
    ... ENTRY %main (p: f32[8]) -> f32[8] {
    ...   %p = f32[8]{0} parameter(0)
    ...   ROOT %ar = f32[8]{0} all-reduce(%p), replica_groups={}, to_apply=%add
    ... }''')
    >>> m.computations["main"].root.opcode
    'all-reduce'
    """
    name, comps, entry, current, is_entry = "", {}, None, None, False
    header = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("HloModule"):
            name = line.split()[1].rstrip(",") if len(line.split()) > 1 else ""
            for key in ("num_partitions", "replica_count"):
                m = re.search(rf"\b{key}=(\d+)", line)
                if m:
                    header[key] = int(m.group(1))
            continue
        if current is None:
            if _INST.match(line) is None and (m := _HEADER.match(line)):
                current, is_entry = {}, bool(m.group(1))
                comp_name = m.group(2)
            continue
        if line == "}":
            comps[comp_name] = Computation(comp_name, current, is_entry)
            if is_entry:
                entry = comp_name
            current = None
            continue
        inst = _parse_instruction(line)
        if inst is not None:
            current[inst.name] = inst
    if entry is None and comps:  # XLA prints the entry computation last
        entry = list(comps)[-1]
    return Module(name, comps, entry, header.get("num_partitions"), header.get("replica_count"))


def _parse_instruction(line: str) -> Instruction | None:
    m = _INST.match(line)
    if m is None:
        return None
    is_root, name, shape_text, opcode, rest = m.groups()
    try:
        shape = parse_shape(shape_text)
    except ValueError:
        shape = None
    rest = _COMMENT.sub("", rest)
    close = _matching(rest, 0, "(", ")")
    if close is None:
        return None
    args = [a.strip() for a in _split_top(rest[:close]) if a.strip()]
    names, shapes, number = [], [], None
    if opcode in _NO_OPERANDS:
        if opcode == "parameter" and args and args[0].isdigit():
            number = int(args[0])
    else:
        for arg in args:
            head, _, tail = arg.rpartition(" ")
            names.append(tail.lstrip("%"))
            try:
                shapes.append(parse_shape(head) if head.strip() else None)
            except ValueError:
                shapes.append(None)
    attrs = {}
    for item in _split_top(rest[close + 1:]):
        key, eq, value = item.strip().partition("=")
        if eq:
            attrs[key.strip()] = value.strip()
    return Instruction(name, opcode, shape, tuple(names), tuple(shapes), attrs, line,
                       bool(is_root), number)


def _matching(text: str, depth: int, open_: str, close: str) -> int | None:
    """Index of the bracket closing an already opened one (quotes respected)."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            if ch == "\\":
                continue
            if ch == quote and text[i - 1] != "\\":
                quote = None
        elif ch == '"':
            quote = ch
        elif ch == open_:
            depth += 1
        elif ch == close:
            if depth == 0:
                return i
            depth -= 1
    return None


def _split_top(text: str) -> Iterator[str]:
    """Splits at commas outside brackets and double quotes."""
    depth, quote, start = 0, False, 0
    for i, ch in enumerate(text):
        if quote:
            if ch == '"' and text[i - 1] != "\\":
                quote = False
        elif ch == '"':
            quote = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


def int_list(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


# ---------------------------------------------------------------- replica groups

_IOTA = re.compile(r"^\[([\d,\s]*)\]<=\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?$")


def replica_groups(inst: Instruction, num_devices: int | None = None) -> list[list[int]] | None:
    """The device groups of a collective, in any syntax XLA prints; None if it has none.

    Explicit ``{{0,1},{2,3}}``; empty ``{}`` (all devices: one group of ``num_devices``, or
    ``[]`` when that is unknown); iota ``[2,4]<=[8]`` and ``[4,2]<=[2,4]T(1,0)``; and mesh
    axes ``mesh['a'=2,'b'=4] {'b'}``, optionally with ``device_ids=(...)`` and sub-axes
    ``'b':(1)2``.
    """
    text = inst.attrs.get("replica_groups")
    if text is None:
        return None
    try:
        return _parse_groups(text.strip(), inst.attrs.get("device_ids"), num_devices)
    except (AttributeError, IndexError, ValueError) as e:  # a regex did not match, bad sizes
        raise ValueError(f"cannot parse replica_groups={text} ({e}) in: {inst.line}") from e


def _parse_groups(text: str, device_ids: str | None,
                  num_devices: int | None) -> list[list[int]]:
    if text.startswith("mesh"):
        return _mesh_groups(text, device_ids)
    if m := _IOTA.match(text.replace(" ", "")):
        shape, reshape = int_list(m.group(1)), int_list(m.group(2))
        ids = np.arange(math.prod(reshape)).reshape(reshape)
        if m.group(3) is not None:
            ids = ids.transpose(int_list(m.group(3)))
        return ids.reshape(shape).tolist()
    if text.startswith("{"):
        groups = [int_list(g) for g in re.findall(r"\{([^{}]*)\}", text[1:-1])]
        if groups:
            return groups
        return [list(range(num_devices))] if num_devices else []
    raise ValueError("unknown syntax")


def _mesh_groups(text: str, device_ids: str | None) -> list[list[int]]:
    # mesh['a'=2,'b'=4] {'b'}   |   mesh['a'=2,'b'=4], device_ids=([2,4]T(1,0)) {'b'}
    axes_text = re.match(r"mesh\[([^\]]*)\]", text).group(1)
    axes = [(n.strip().strip("'\""), int(s)) for n, s in
            (a.rsplit("=", 1) for a in axes_text.split(",") if a.strip())]
    tail = device_ids if device_ids is not None else text
    group_text = re.search(r"\{([^{}]*)\}\s*$", tail).group(1)
    n = math.prod(s for _, s in axes)
    devices = np.arange(n)
    if device_ids is not None:
        ids_text = tail[:tail.rindex("{")].strip().removeprefix("(").removesuffix(")")
        devices = _device_array(ids_text, n)
    refs = []  # (mesh axis index, pre_size or None, size)
    for ref in re.findall(r"'[^']*'(?::\(\d+\)\d+)?|[\w.\-]+(?::\(\d+\)\d+)?", group_text):
        m = re.match(r"'?([^':]*)'?(?::\((\d+)\)(\d+))?$", ref)
        idx = [a for a, _ in axes].index(m.group(1))
        refs.append((idx, int(m.group(2)) if m.group(2) else None,
                     int(m.group(3)) if m.group(3) else axes[idx][1]))
    # split each mesh axis at its sub-axis boundaries (major to minor), then group the refs
    dims, ref_dim = [], {}
    for idx, (_, size) in enumerate(axes):
        subs = [(pre, sz) for i, pre, sz in refs if i == idx and pre is not None]
        bounds = sorted({1, size, *(p for p, _ in subs), *(p * s for p, s in subs)})
        base = len(dims)
        dims += [b // a for a, b in zip(bounds, bounds[1:], strict=False)] or [1]
        for i, pre, _ in refs:
            if i == idx:
                ref_dim[(i, pre)] = base + (bounds.index(pre) if pre is not None else 0)
    grouped = [ref_dim[(i, pre)] for i, pre, _ in refs]
    order = [d for d in range(len(dims)) if d not in grouped] + grouped
    size = math.prod(dims[d] for d in grouped)
    return devices.reshape(dims).transpose(order).reshape(-1, size).tolist()


def _device_array(text: str, n: int) -> np.ndarray:
    m = re.match(r"^\[([\d,\s]*)\](?:<=\[([\d,\s]*)\])?(?:T\(([\d,\s]*)\))?$", text.strip())
    if m is None:  # an explicit list of ids
        return np.array(int_list(text))
    reshape = int_list(m.group(2) if m.group(2) is not None else m.group(1))
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if m.group(3) is not None:
        ids = ids.transpose(int_list(m.group(3)))
    return ids.reshape(n)


def source_target_pairs(inst: Instruction) -> list[list[int]] | None:
    text = inst.attrs.get("source_target_pairs")
    return None if text is None else [int_list(p) for p in re.findall(r"\{([^{}]*)\}", text)]


# ---------------------------------------------------------------- call graph

_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _comp_names(text: str) -> list[str]:
    return [n.strip().lstrip("%") for n in text.strip("{} ").split(",") if n.strip()]


def callees(inst: Instruction) -> list[tuple[str, str, int | None]]:
    """(computation, role, times per execution of `inst`) for computations `inst` runs.

    Reducers and comparators (``to_apply`` of reduce, all-reduce, sort, ...) are not included:
    they are scalar functions, not program code. A while without ``known_trip_count`` gets
    ``None`` times.
    """
    a, op = inst.attrs, inst.opcode
    if op == "while" and "body" in a and "condition" in a:
        m = _TRIP.search(a.get("backend_config", ""))
        n = int(m.group(1)) if m else None
        return [(a["body"].lstrip("%"), "body", n),
                (a["condition"].lstrip("%"), "condition", None if n is None else n + 1)]
    if op == "conditional":
        names = _comp_names(a["branch_computations"]) if "branch_computations" in a else \
            [a[k].lstrip("%") for k in ("true_computation", "false_computation") if k in a]
        return [(n, "branch", 1) for n in names]
    key = {"fusion": "calls", "call": "to_apply", "async-start": "calls",
           "custom-call": "called_computations"}.get(op)
    if op == "call" and "to_apply" not in a:
        key = "calls"
    if key is None or key not in a:
        return []
    return [(n, op, 1) for n in _comp_names(a[key])]


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
