"""Shared helper of the rule-family table tests.

A :class:`Row` is one case: a function, its arguments, the user's specs for (some) inputs, and
what an expert expects: the propagated spec of the outputs (and of chosen intermediates), and
the exact set of collective kinds XLA compiles. :func:`check` asserts these, numerical equality
with the unsharded program (rtol 1e-5; atol 1e-6 times the largest |output|), and that the
collectives the plan's own model implies (``plan.reshards``, what the cost model prices) are of
the same kinds unless the row says otherwise.

Intermediates are named by primitive: ``"reshape"`` is the first result of the first ``reshape``
op in program order (regions included), ``"reshape#1"`` the second one's, ``"cumsum:1"`` the
second result of the first ``cumsum``.

Every plan pins all intermediates (``pins="all"``, no arbiter) so that XLA compiles the propagated
plan, not its own propagation: the collectives measured are those the rules imply.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap.shardings import from_partition_spec, to_partition_spec

MESH_2x4 = (("data", 2), ("model", 4))
MESH_8 = (("x", 8),)
# fp32, rtol 1e-5; the absolute floor scales with the output's magnitude (a sum computed in
# another order differs by a few ulps of its largest terms, not of its result)
RTOL, ATOL = 1e-5, 1e-6
# XLA:CPU compiles these tiny programs much faster without optimisation passes; SPMD
# partitioning (and so the collectives) is unaffected.
FAST = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}


@functools.cache
def mesh(axes: tuple[tuple[str, int], ...] = MESH_2x4) -> jax.sharding.Mesh:
    return automap.make_mesh(dict(axes))


# ---------------------------------------------------------------------------------------------
# arguments


@dataclasses.dataclass(frozen=True)
class Ints:
    """An int32 argument of ``shape`` with values in ``[0, high)``."""

    shape: tuple[int, ...]
    high: int


def ints(shape: Sequence[int], high: int) -> Ints:
    return Ints(tuple(shape), high)


def materialize(args: Sequence[Any], seed: int = 0) -> list[Any]:
    """Concrete arrays: float32 normals for shape tuples, ints in range for :class:`Ints`."""
    rng = np.random.default_rng(seed)
    out = []
    for a in args:
        if isinstance(a, tuple):
            out.append(jax.numpy.asarray(rng.standard_normal(a), dtype=np.float32))
        elif isinstance(a, Ints):
            out.append(jax.numpy.asarray(rng.integers(0, a.high, a.shape), dtype=np.int32))
        else:
            out.append(a)
    return out


# ---------------------------------------------------------------------------------------------
# rows


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    fn: Callable
    args: tuple[Any, ...]  # shapes (float32), Ints, or arrays
    specs: Mapping[str, P]  # input path (e.g. "x", "params/w") -> PartitionSpec
    out: P | tuple[P, ...]  # expected spec of the output (a tuple of specs: one per output leaf)
    collectives: frozenset[str]  # exact set of kinds in the compiled HLO
    mesh: tuple[tuple[str, int], ...] = MESH_2x4
    inner: Mapping[str, P] = dataclasses.field(default_factory=dict)  # "prim[#k][:j]" -> spec
    strict: bool = True  # a primitive without a rule is an error
    # kinds of the collectives the plan's own model implies (plan.reshards): None, the same as
    # ``collectives``; UNCHECKED, not compared
    model: frozenset[str] | str | None = None


UNCHECKED = "unchecked"


def row(name: str, fn: Callable, args: Sequence[Any], specs: Mapping[str, P], out: Any,
        collectives: set[str] | frozenset[str], *, mesh: tuple = MESH_2x4,
        inner: Mapping[str, P] | None = None, strict: bool = True, model: Any = None, marks: Any = ()) -> Any:
    """One table row as a ``pytest.param`` with id ``name``."""
    model = frozenset(model) if isinstance(model, (set, frozenset)) else model
    r = Row(name, fn, tuple(args), dict(specs), out, frozenset(collectives), mesh, dict(inner or {}), strict, model)
    return pytest.param(r, id=name, marks=marks)


@dataclasses.dataclass
class Result:
    plan: Any
    outputs: list[Any]  # flat, sharded run
    expected: list[Any]  # flat, unsharded run
    measurement: automap.Measurement
    compiled: Any


def _unpaired(fn: Callable) -> Callable:
    """``fn`` with its result wrapped in a dict. The planner ties an output that has an argument's
    structure, shape and dtype to that argument's spec (state in, state out); a rule test wants
    the spec the rules propagate, so no output may look like an argument."""

    @functools.wraps(fn)
    def wrapped(*args: Any) -> Any:
        return {"out": fn(*args)}

    return wrapped


def partition(r: Row) -> tuple[automap.Partitioned, list[Any]]:
    rules = {f"^{re.escape(path)}$": spec for path, spec in r.specs.items()}
    schedule = [tactics.manual(rules)] if rules else []
    step = automap.partition(_unpaired(r.fn), mesh=mesh(r.mesh), tactics=schedule, search=None, strict=r.strict,
                             pins="all", arbiter=None)
    return step, materialize(r.args)


def run(r: Row) -> Result:
    """Plan, compile and run ``r.fn`` partitioned; run it unsharded for comparison."""
    step, args = partition(r)
    plan = step.plan(*args)
    unknown = set(r.specs) - set(plan.program.input_paths)
    assert not unknown, f"specs for {unknown}, but the inputs are {plan.program.input_paths}"
    # run the very executable that is measured (step(*args) would compile it again)
    compiled = step.lower(*args).compile(compiler_options=FAST)
    leaves = jax.tree.leaves(args)
    placed = [jax.device_put(x, s) for x, s in zip(leaves, jax.tree.leaves(plan.in_shardings), strict=True)]
    outs = list(compiled(*placed))
    reference = jax.jit(r.fn).lower(*args).compile(compiler_options=FAST)
    expected = jax.tree.leaves(reference(*args))
    return Result(plan, outs, expected, automap.measure(compiled), compiled)


def op_result(plan: Any, name: str) -> int:
    """The value id named ``prim``, ``prim#k`` (k-th op of that primitive) or ``...:j`` (result j)."""
    m = re.fullmatch(r"([\w\-]+)(?:#(\d+))?(?::(\d+))?", name)
    assert m, f"bad intermediate name {name!r}"
    prim, k, j = m.group(1), int(m.group(2) or 0), int(m.group(3) or 0)
    ops = [op for op in plan.program.all_ops if op.primitive == prim]
    assert len(ops) > k, f"program has {len(ops)} '{prim}' ops: {sorted(plan.program.primitives())}"
    return ops[k].outputs[j]


def spec_of(plan: Any, vid: int) -> P:
    return to_partition_spec(plan.state.spec(vid))


def normalize(pspec: P, ndim: int) -> P:
    return to_partition_spec(from_partition_spec(pspec, ndim))


def check(r: Row) -> Result:
    """Assert the row: propagated specs, numerics against the unsharded program, collective kinds."""
    res = run(r)
    plan = res.plan
    outs = plan.program.outputs
    want = r.out if isinstance(r.out, tuple) else (r.out,)
    assert len(want) == len(outs), f"{len(outs)} outputs, the row expects {len(want)}"
    for i, (vid, w) in enumerate(zip(outs, want, strict=True)):
        v = plan.program.values[vid]
        got = spec_of(plan, vid)
        assert got == normalize(w, v.ndim), f"output {i} {v.shape}: propagated {got}, expected {w}"
        sharding = res.outputs[i].sharding
        assert sharding.is_equivalent_to(jax.sharding.NamedSharding(sharding.mesh, w), v.ndim), (
            f"output {i}: compiled sharding {sharding.spec}, expected {w}"
        )
    for name, w in r.inner.items():
        vid = op_result(plan, name)
        v = plan.program.values[vid]
        got = spec_of(plan, vid)
        assert got == normalize(w, v.ndim), f"{name} {v.shape}: propagated {got}, expected {w}"
    for i, (got, exp) in enumerate(zip(res.outputs, res.expected, strict=True)):
        got, exp = np.asarray(got), np.asarray(exp)
        assert got.shape == exp.shape and got.dtype == exp.dtype, f"output {i}: {got.shape} {got.dtype}"
        if np.issubdtype(exp.dtype, np.inexact):
            atol = ATOL * max(1.0, float(np.max(np.abs(exp), initial=0.0)))
            np.testing.assert_allclose(got, exp, rtol=RTOL, atol=atol, err_msg=f"output {i}")
        else:
            np.testing.assert_array_equal(got, exp, err_msg=f"output {i}")
    kinds = set(res.measurement.collectives)
    assert kinds == set(r.collectives), (
        f"compiled collectives {kinds}, expected {set(r.collectives)}\n{res.measurement.summary()}"
    )
    if r.model != UNCHECKED:
        model = {x.kind for x in plan.reshards}
        want_model = set(r.collectives if r.model is None else r.model)
        assert model == want_model, f"the plan implies {model}, expected {want_model}: {plan.reshards}"
    return res
