"""A small parser for XLA's HLO text: just enough structure to measure a compiled program.

`parse_module(text)` turns the output of `jax.stages.Compiled.as_text()` (or a hand-written
snippet) into computations of instructions with parsed result shapes, operand names and raw
attribute strings. Lines it does not understand are skipped; an instruction whose result shape
cannot be parsed is kept with `shape=None` so that callers decide whether that is fatal.
A collective's device groups are read by :mod:`automap.hlo_device_groups`; what runs how often
and what depends on what, across calls and loops, by :mod:`automap.hlo_call_graph`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Iterator
from typing import Union

__all__ = [
    "ArrayShape", "TupleShape", "Shape", "Instruction", "Computation", "Module",
    "parse_shape", "parse_module", "callees", "int_list",
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
