"""Plan files: save a :class:`~automap.plan.Plan` as JSON, load it back for the same function.

The file (format ``automap-plan``, version 1) holds:

- ``fingerprint``: ``sha256:`` of the lowered program's structure (every op's primitive, value
  ids, shapes, dtypes and simple parameters, in program order, the literals and constants, and
  the input/output paths). It is the same in every process and run for the same function and
  shapes, and changes when the function or a shape does. Value ids are part of it, so equal
  fingerprints mean equal ids.
- ``mesh``: axis names and sizes, in mesh order.
- ``inputs`` / ``outputs``: per leaf its path, shape, dtype, value id and spec (a list per dim
  of mesh axis names); inputs also say why they got their spec.
- ``values``: ``[value id, spec]`` for every sharded value (intermediates included),
  ``priority`` / ``labels``: which decision sharded each dim (what the cost model needs), ``pins``:
  the value ids that get sharding constraints, ``notes``, and ``ops`` (one line per op, only used to
  say what changed); ``recomputed`` (only when there are any): the blocks whose residuals the
  backward recomputes (:mod:`automap.ir.recompute`, applied again on loading: the copies' value
  ids are the same for the same program); ``dropped_remat`` (only when true): the model's own
  remat was dropped (:mod:`automap.ir.unremat`, applied again on loading, before ``recomputed``).

Using a stored plan re-propagates nothing: the function is traced and lowered, its fingerprint
and the mesh are checked, and the stored specs are set as they are.

>>> import json, os, tempfile, jax.numpy as jnp, automap
>>> mesh = automap.make_mesh({"data": 2})
>>> f = automap.partition(lambda x: jnp.tanh(x) * 2, mesh=mesh)
>>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
>>> f.plan(jnp.ones((8, 4))).save(path)
>>> data = json.load(open(path))
>>> data["format"], data["mesh"], data["inputs"][0]["spec"]
('automap-plan', {'axis_names': ['data'], 'axis_sizes': [2]}, [['data'], []])
>>> g = automap.partition(lambda x: jnp.tanh(x) * 2, mesh=mesh, plan=path)
>>> g.plan(jnp.ones((8, 4))).in_shardings[0].spec
P('data',)
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from jax.sharding import Mesh

from automap.atomic import write_file
from automap.ir.program import Program
from automap.shardings import ShardingState, Spec

FORMAT, VERSION = "automap-plan", 1


class PlanMismatchError(ValueError):
    """A stored plan does not fit the function, its arguments or the mesh it is used with."""


# ------------------------------------------------------------------------------ fingerprint

def _stable(x: Any) -> Any:
    """A process-independent description of a primitive parameter (no ids or addresses)."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, np.dtype):
        return str(x)
    if isinstance(x, type):
        return x.__name__
    if isinstance(x, (tuple, list)):
        return [type(x).__name__] + [_stable(v) for v in x]
    if isinstance(x, (frozenset, set)):
        return sorted(repr(_stable(v)) for v in x)
    text = repr(x)  # enums, extended dtypes, ...; not jaxprs (walked anyway) nor functions (addresses)
    return text if "0x" not in text and len(text) < 200 else type(x).__name__


def _constant(x: Any) -> str:
    """A literal's or closed-over constant's value (a digest; only the shape past 1 MiB)."""
    try:
        a = np.asarray(x)
        if a.dtype == object or a.nbytes > 1 << 20:
            return f"{a.dtype}{list(a.shape)}"
        return f"{a.dtype}{list(a.shape)}:" + hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:16]
    except Exception:  # extended dtypes (PRNG keys) and the like
        return type(x).__name__


def _aval(program: Program, vid: int) -> str:
    v = program.values[vid]
    return f"{v.dtype}[{','.join(map(str, v.shape))}]"


def op_lines(program: Program) -> list[str]:
    """One readable line per op (program order, regions after their op)."""
    return [
        f"{op.primitive} {' '.join(_aval(program, v) for v in op.inputs)} -> "
        f"{' '.join(_aval(program, v) for v in op.outputs)}"
        for op in program.all_ops
    ]


def fingerprint(program: Program) -> str:
    """A stable hash of the program's structure (see the module docstring).

    >>> import jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.trace import trace
    >>> def fp(f, x):
    ...     t = trace(f, (x,))
    ...     return fingerprint(lower(t.closed_jaxpr, t.in_paths, t.out_paths))
    >>> fp(jnp.tanh, jnp.ones(4)) == fp(jnp.tanh, jnp.ones(4)) != fp(jnp.tanh, jnp.ones(8))
    True
    """
    parts: list[Any] = [list(program.input_paths), list(program.output_paths)]
    parts.append([[v, _aval(program, v)] for v in program.inputs + program.outputs])
    parts.append([[v.id, _constant(v.literal)] for v in program.values if v.kind in ("literal", "const")])
    for op in program.all_ops:
        params = {k: _stable(p) for k, p in sorted(op.params.items())}
        parts.append([op.primitive, list(op.inputs), list(op.outputs),
                      [_aval(program, v) for v in op.inputs + op.outputs], params,
                      [[r.role, r.trips, list(r.inputs), list(r.outputs)] for r in op.regions]])
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


# ------------------------------------------------------------------------------ writing

def _spec_json(spec: Spec) -> list[list[str]]:
    return [list(axes) for axes in spec]


def _spec(data: Sequence[Sequence[str]]) -> Spec:
    return tuple(tuple(axes) for axes in data)


def _leaves(program: Program, vids: Sequence[int], paths: Sequence[str], specs: Sequence[Spec]) -> list[dict]:
    return [
        {"path": p, "shape": list(program.values[v].shape), "dtype": str(program.values[v].dtype), "value": v,
         "spec": _spec_json(s)}
        for v, p, s in zip(vids, paths, specs, strict=True)
    ]


def to_json(plan: Any) -> dict:
    """The plan as a JSON-ready dict (the file format above)."""
    program, state = plan.program, plan.state
    inputs = _leaves(program, program.inputs, program.input_paths, [state.spec(v) for v in program.inputs])
    for row, vid in zip(inputs, program.inputs, strict=True):
        row["why"] = plan.reasons.get(vid, "")
    return {
        "format": FORMAT,
        "version": VERSION,
        "fingerprint": fingerprint(program),
        "mesh": {"axis_names": [str(a) for a in plan.mesh.axis_names],
                 "axis_sizes": [int(plan.mesh.shape[a]) for a in plan.mesh.axis_names]},
        "inputs": inputs,
        "outputs": _leaves(program, program.outputs, program.output_paths, plan.out_specs),
        "values": [[v, _spec_json(s)] for v, s in sorted(state.specs.items()) if any(s)],
        "priority": [[v, d, p] for (v, d), p in sorted(state.priority.items())],
        "labels": {str(p): label for p, label in sorted(state.labels.items())},
        "next_priority": state.next_priority,
        "pins": sorted(plan.pins),
        "notes": list(plan.notes),
        "ops": op_lines(program),
    } | ({"recomputed": list(state.program.recomputed)} if state.program.recomputed else {}) | (
        {"dropped_remat": True} if state.program.dropped_remat else {})


def save(plan: Any, path: str | os.PathLike) -> None:
    """Write ``plan`` to ``path`` as JSON (see :meth:`automap.Plan.save`); an existing file is
    replaced atomically (a crash leaves the old or the new file, :mod:`automap.atomic`)."""
    write_file(path, json.dumps(to_json(plan), indent=1) + "\n")


# ------------------------------------------------------------------------------ reading

def _mesh_axes(mesh: Mesh) -> dict[str, int]:
    return {str(a): int(mesh.shape[a]) for a in mesh.axis_names}


@dataclasses.dataclass(frozen=True, eq=False)
class StoredPlan:
    """A plan file loaded for a mesh; :meth:`build` turns it into a Plan for a function.

    Made by :meth:`automap.Plan.load`; pass it (or the file's path) as ``plan=`` to
    :func:`automap.automap`.
    """

    data: Mapping[str, Any]
    mesh: Mesh
    source: str = "<memory>"

    @staticmethod
    def load(path: str | os.PathLike, mesh: Mesh) -> "StoredPlan":
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise PlanMismatchError(
                f"{path} is not a plan file (invalid JSON: {e}); write one with plan.save(path)") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanMismatchError(
                f"{path} is not an automap plan file (no \"format\": \"{FORMAT}\"); write one with plan.save(path)")
        version = data.get("version")
        if version != VERSION or isinstance(version, bool):
            raise PlanMismatchError(
                f"{path} is plan format version {version!r}, this automap reads version {VERSION}; "
                "replan with this version (leave out plan=) and save again"
            )
        from automap.plan_schema import check

        check(data, str(path))
        stored = StoredPlan(data, mesh, str(path))
        stored.check_mesh(mesh)
        return stored

    @property
    def fingerprint(self) -> str:
        return self.data["fingerprint"]

    def check_mesh(self, mesh: Mesh) -> None:
        """Raise :class:`PlanMismatchError` naming the axes that differ from the stored mesh."""
        want = dict(zip(self.data["mesh"]["axis_names"], self.data["mesh"]["axis_sizes"], strict=True))
        got = _mesh_axes(mesh)
        if list(want.items()) == list(got.items()):
            return
        diffs = [f"axis '{a}': size {n} in the plan, {got[a]} in the mesh"
                 for a, n in want.items() if a in got and got[a] != n]
        diffs += [f"axis '{a}' is missing from the mesh" for a in want if a not in got]
        diffs += [f"axis '{a}' is not in the plan" for a in got if a not in want]
        if not diffs:
            diffs = [f"axis order {list(want)} in the plan, {list(got)} in the mesh"]
        raise PlanMismatchError(
            f"plan {self.source} was saved for mesh {want} but is used with mesh {got} ({'; '.join(diffs)}); pass "
            f"the matching mesh (automap.make_mesh({want})), or replan on this mesh (leave out plan=) and save again"
        )

    def check_program(self, program: Program) -> None:
        """Raise :class:`PlanMismatchError` naming what differs if the fingerprints differ."""
        if fingerprint(program) == self.fingerprint:
            return
        raise PlanMismatchError(
            f"plan {self.source} was saved for another program: {self._what_changed(program)}; replan for this "
            "function and these arguments (leave out plan=, then plan.save(path) again), or call the function it was "
            "made for with the arguments it was made for"
        )

    def _what_changed(self, program: Program) -> str:
        parts = []
        for kind, rows, paths, vids in (("input", self.data["inputs"], program.input_paths, program.inputs),
                                        ("output", self.data["outputs"], program.output_paths, program.outputs)):
            stored = {r["path"]: (tuple(r["shape"]), r["dtype"]) for r in rows}
            now = {p: (program.values[v].shape, str(program.values[v].dtype)) for p, v in zip(paths, vids, strict=True)}
            parts += [f"{kind} '{p}' is gone" for p in stored if p not in now]
            parts += [f"{kind} '{p}' is new" for p in now if p not in stored]
            parts += [f"{kind} '{p}' was {_fmt(stored[p])}, now {_fmt(now[p])}" for p in now
                      if p in stored and stored[p] != now[p]]
            if not parts and list(stored) != list(now):
                parts.append(f"the {kind}s are in another order")
        if parts:
            return ", ".join(parts)
        old, new = self.data.get("ops", []), op_lines(program)
        for k, (a, b) in enumerate(zip(old, new)):
            if a != b:
                op = program.all_ops[k]
                return f"the function's body changed at op {k}: the plan has '{a}', the function has '{b}' ({op.source})"
        if len(old) != len(new):
            return f"the function's body changed: the plan has {len(old)} ops, the function has {len(new)}"
        return ("the same inputs, outputs and ops, but other constants or op parameters (e.g. a literal, "
                "dimension numbers or axes)")

    def build(
        self, fn: Callable, args: Sequence[Any], *, static_argnums: Sequence[int] = (), strict: bool = False,
        topology: Any = None, donate_argnums: Sequence[int] = (),
    ) -> Any:
        """Trace and lower ``fn(*args)``, check it against the stored plan, and set the stored specs."""
        from automap.plan import Plan
        from automap.ir.recompute import recompute
        from automap.ir.unremat import drop_remat
        from automap.planner import donated_inputs, trace_and_lower

        traced, program = trace_and_lower(fn, args, static_argnums=static_argnums, strict=strict)
        self.check_program(program)
        from automap.plan_schema import check_program_ids

        d = self.data
        planned = drop_remat(program) if d.get("dropped_remat") else program  # the model's remat, if dropped
        planned = recompute(planned, d.get("recomputed", ()))  # the blocks the plan recomputes, if any
        check_program_ids(self.data, self.source, planned)
        axes = _mesh_axes(self.mesh)
        state = ShardingState(
            planned, axes,
            specs={int(v): _spec(s) for v, s in d["values"]},
            priority={(int(v), int(dim)): int(p) for v, dim, p in d["priority"]},
            next_priority=int(d["next_priority"]),
            labels={int(p): label for p, label in d["labels"].items()},
        )
        reasons = {int(r["value"]): r["why"] for r in d["inputs"] if r.get("why")}
        out_specs = tuple(_spec(r["spec"]) for r in d["outputs"])
        donated = donated_inputs(program, traced, len(args), static_argnums, donate_argnums)
        notes = tuple(d.get("notes", ())) + (f"loaded from {self.source}",)
        return Plan(self.mesh, traced, program, state, frozenset(int(v) for v in d["pins"]), out_specs, notes,
                    reasons, topology, donated)


def _fmt(shape_dtype: tuple) -> str:
    shape, dtype = shape_dtype
    return f"{dtype}{list(shape)}"
