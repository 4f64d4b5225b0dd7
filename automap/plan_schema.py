"""The plan file's schema (format: :mod:`automap.plan_io`), checked when a file is loaded and
again against the program it is used for: a missing or malformed field, a spec naming an axis the
mesh lacks or an axis twice, a value id or dim the program does not have each raise
:class:`PlanFileError` naming the file and the field; nothing malformed is used silently.

>>> check({"format": "automap-plan", "version": 1}, "plan.json")
Traceback (most recent call last):
...
automap.plan_schema.PlanFileError: plan.json: field 'fingerprint' is missing; ...
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from automap.ir.program import Program
from automap.plan_io import PlanMismatchError

__all__ = ["PlanFileError", "check", "check_program_ids"]


class PlanFileError(PlanMismatchError):
    """A plan file is malformed: a field is missing, of the wrong type, or names what does not exist."""


def _fail(source: str, field: str, what: str) -> PlanFileError:
    return PlanFileError(
        f"{source}: field '{field}' {what}; the file was edited or damaged: replan (leave out plan=) and save it "
        "again with plan.save(path)"
    )


_MISSING = object()


def _present(source: str, field: str, x: Any) -> None:
    if x is _MISSING:
        raise _fail(source, field, "is missing")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int(source: str, field: str, x: Any, low: int = 0) -> int:
    _present(source, field, x)
    if not _is_int(x) or x < low:
        raise _fail(source, field, f"must be an integer >= {low}, got {x!r}")
    return x


def _list(source: str, field: str, x: Any, length: int | None = None) -> list:
    _present(source, field, x)
    if not isinstance(x, list):
        raise _fail(source, field, f"must be a list, got {type(x).__name__} {_short(x)}")
    if length is not None and len(x) != length:
        raise _fail(source, field, f"must have {length} entries, got {len(x)}: {_short(x)}")
    return x


def _str(source: str, field: str, x: Any) -> str:
    _present(source, field, x)
    if not isinstance(x, str):
        raise _fail(source, field, f"must be a string, got {type(x).__name__} {_short(x)}")
    return x


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 80 else text[:77] + "..."


def _spec(source: str, field: str, x: Any, axes: Mapping[str, int], rank: int | None = None) -> None:
    _list(source, field, x, rank)
    seen: set[str] = set()
    for d, dim in enumerate(x):
        for a in _list(source, f"{field}[{d}]", dim):
            if a not in axes:
                raise _fail(source, f"{field}[{d}]", f"names mesh axis {a!r}, but the plan's mesh has axes {list(axes)}")
            if a in seen:
                raise _fail(source, f"{field}[{d}]", f"names mesh axis {a!r} a second time (an axis shards at most one dim)")
            seen.add(a)


def _get(data: Mapping[str, Any], source: str, field: str) -> Any:
    _present(source, field, data.get(field, _MISSING))
    return data[field]


def check(data: Mapping[str, Any], source: str) -> None:
    """Check the structure of a loaded plan file (``format`` and ``version`` already checked)."""
    fp = _str(source, "fingerprint", _get(data, source, "fingerprint"))
    if not fp.startswith("sha256:"):
        raise _fail(source, "fingerprint", f"must start with 'sha256:', got {_short(fp)}")
    mesh = _get(data, source, "mesh")
    if not isinstance(mesh, dict):
        raise _fail(source, "mesh", f"must be an object with axis_names and axis_sizes, got {_short(mesh)}")
    names = _list(source, "mesh.axis_names", mesh.get("axis_names", _MISSING))
    for i, a in enumerate(names):
        _str(source, f"mesh.axis_names[{i}]", a)
    sizes = _list(source, "mesh.axis_sizes", mesh.get("axis_sizes", _MISSING), len(names))
    axes = {a: _int(source, f"mesh.axis_sizes[{i}]", n, 1) for i, (a, n) in enumerate(zip(names, sizes, strict=True))}
    if len(axes) != len(names):
        raise _fail(source, "mesh.axis_names", f"names an axis twice: {names}")
    for kind in ("inputs", "outputs"):
        for i, row in enumerate(_list(source, kind, _get(data, source, kind))):
            where = f"{kind}[{i}]"
            if not isinstance(row, dict):
                raise _fail(source, where, f"must be an object, got {_short(row)}")
            for key in ("path", "dtype"):
                _str(source, f"{where}.{key}", row.get(key, _MISSING))
            shape = _list(source, f"{where}.shape", row.get("shape", _MISSING))
            for d, n in enumerate(shape):
                _int(source, f"{where}.shape[{d}]", n)
            _int(source, f"{where}.value", row.get("value", _MISSING))
            _spec(source, f"{where}.spec", row.get("spec", _MISSING), axes, len(shape))
            if "why" in row:
                _str(source, f"{where}.why", row["why"])
    for i, entry in enumerate(_list(source, "values", _get(data, source, "values"))):
        _list(source, f"values[{i}]", entry, 2)
        _int(source, f"values[{i}][0]", entry[0])
        _spec(source, f"values[{i}][1]", entry[1], axes)
    for i, entry in enumerate(_list(source, "priority", _get(data, source, "priority"))):
        for k, x in enumerate(_list(source, f"priority[{i}]", entry, 3)):
            _int(source, f"priority[{i}][{k}]", x)
    labels = _get(data, source, "labels")
    if not isinstance(labels, dict) or not all(k.lstrip("-").isdigit() and isinstance(v, str) for k, v in labels.items()):
        raise _fail(source, "labels", f"must map priorities (\"0\", \"1\", ...) to strings, got {_short(labels)}")
    _int(source, "next_priority", _get(data, source, "next_priority"))
    for i, v in enumerate(_list(source, "pins", _get(data, source, "pins"))):
        _int(source, f"pins[{i}]", v)
    for key in ("notes", "ops"):  # optional
        for i, line in enumerate(_list(source, key, data.get(key, []))):
            _str(source, f"{key}[{i}]", line)


def check_program_ids(data: Mapping[str, Any], source: str, program: Program) -> None:
    """Every value id, dim and spec of the file fits ``program`` (whose fingerprint matched)."""
    axes = dict(zip(data["mesh"]["axis_names"], data["mesh"]["axis_sizes"], strict=True))

    def value(field: str, vid: int) -> Any:
        if vid >= len(program.values):
            raise _fail(source, field, f"names value {vid}, but the program has values 0..{len(program.values) - 1}")
        return program.values[vid]

    def fits(field: str, vid: int, spec: list) -> None:
        shape = value(field, vid).shape
        if len(spec) != len(shape):
            raise _fail(source, field, f"has {len(spec)} entries for value {vid} of rank {len(shape)}")
        for d, dim in enumerate(spec):
            n = math.prod(axes[a] for a in dim)
            if shape[d] % n:
                raise _fail(source, f"{field}[{d}]", f"shards dim {d} of size {shape[d]} over {dim} ({n} devices), "
                                                    "which does not divide it")

    for i, (vid, spec) in enumerate(data["values"]):
        fits(f"values[{i}][1]", vid, spec)
    for kind in ("inputs", "outputs"):
        for i, row in enumerate(data[kind]):
            fits(f"{kind}[{i}].spec", row["value"], row["spec"])
    for i, (vid, dim, _) in enumerate(data["priority"]):
        if dim >= len(value(f"priority[{i}][0]", vid).shape):
            raise _fail(source, f"priority[{i}][1]", f"names dim {dim} of value {vid}, which has rank "
                                                     f"{len(program.values[vid].shape)}")
    for i, vid in enumerate(data["pins"]):
        value(f"pins[{i}]", vid)
