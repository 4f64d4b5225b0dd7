"""Lowering: a ClosedJaxpr to a :class:`~automap.ir.program.Program`.

Calls (jit, custom_jvp/vjp, remat, name) are inlined; ``scan``, ``cond`` and ``while`` keep their
bodies as regions, linked to the outer op by a factor rule (see :func:`link_rule`).

A ``select_n`` whose cases are one value, or splats of one scalar, is that value (see
:meth:`_Lowering.same_cases`): XLA folds it before it lays anything out, and the predicate it
no longer reads is dead code.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import numpy as np

from automap import _compat
from automap.ir.program import Op, Phase, Program, Region, RematCall, Value
import automap.rules  # noqa: F401  (registers the rule families)
from automap.rules import registry
from automap.rules.registry import DimFactors, Factor, FactorRule, RuleContext, Shaped

_WRAPPER = re.compile(r"[A-Za-z_]\w*\(")


def module_path(name_stack: str) -> str:
    """``'transpose(jvp(GPT/blocks_0))/attn'`` -> ``'GPT/blocks_0/attn'``."""
    path = _WRAPPER.sub("", name_stack).replace(")", "")
    return "/".join(p for p in path.split("/") if p and p != "rematted_computation")


def phase_of(name_stack: str) -> Phase | None:
    if "transpose(" in name_stack:
        return "backward"
    if "jvp(" in name_stack:
        return "forward"
    return None


class _Lowering:
    def __init__(self, strict: bool):
        self.strict = strict
        self.values: list[Value] = []
        self.n_ops = 0
        self.n_regions = 0
        self.remat_calls: dict[int, RematCall] = {}
        self.seen_backward = False
        self.rules: dict[Any, tuple[FactorRule, bool]] = {}
        self.splats: dict[int, bytes] = {}  # a broadcast of a scalar literal -> the literal's bytes

    def rule(self, ctx: RuleContext, params: dict, primitive: Any = None) -> tuple[FactorRule, bool]:
        """The factor rule, memoised on (primitive, shapes, params): repeated layers share it."""
        try:
            key = (ctx.primitive, ctx.operands, ctx.results, tuple(sorted(params.items())))
            hash(key)
        except TypeError:
            return registry.rule_for(ctx, params, strict=self.strict, primitive=primitive)
        got = self.rules.get(key)
        if got is None:
            got = self.rules[key] = registry.rule_for(ctx, params, strict=self.strict, primitive=primitive)
        return got

    # -- values -------------------------------------------------------------------------------
    def new_value(self, aval: Any, name: str, kind: str, phase: Phase, region: int, literal: Any = None) -> int:
        vid = len(self.values)
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        dtype = getattr(aval, "dtype", None)
        self.values.append(
            Value(vid, shape, dtype, name, kind, phase, _compat.itemsize(dtype), region, literal)  # type: ignore[arg-type]
        )
        return vid

    def read(self, env: dict, atom: Any, region: int) -> int:
        if _compat.is_literal(atom):
            return self.new_value(atom.aval, "literal", "literal", "forward", region, atom.val)
        return env[atom]

    # -- jaxprs -------------------------------------------------------------------------------
    def lower_jaxpr(
        self, jaxpr: Any, consts: Sequence[Any], in_ids: Sequence[int], ctx: "_Scope"
    ) -> tuple[list[Op], list[int]]:
        env: dict[Any, int] = {}
        for var, c in zip(jaxpr.constvars, consts, strict=True):
            name = f"{ctx.module}/const" if ctx.module else "const"
            env[var] = self.new_value(var.aval, name, "const", "forward", ctx.region, c)
        for var, vid in zip(jaxpr.invars, in_ids, strict=True):
            env[var] = vid
        ops: list[Op] = []
        for eqn in jaxpr.eqns:
            self.lower_eqn(eqn, env, ops, ctx)
        outs = [self.read(env, v, ctx.region) for v in jaxpr.outvars]
        return ops, outs

    def lower_eqn(self, eqn: Any, env: dict, ops: list[Op], scope: "_Scope") -> None:
        prim = eqn.primitive.name
        stack = _compat.name_stack_of(eqn)
        module = "/".join(p for p in (scope.module, module_path(stack)) if p)
        in_ids = [self.read(env, a, scope.region) for a in eqn.invars]
        phase = phase_of(stack) or scope.phase
        if phase is None:  # outside any transform: optimizer work once gradients exist, else forward
            phase = "optimizer" if self.seen_backward else "forward"
        if phase == "backward":
            self.seen_backward = True

        if prim in _compat.INLINE_CALLS:
            body, consts = _compat.inline_body(eqn)
            inner = scope.child(phase=phase_of(stack) or scope.phase, module=module)
            if prim in _compat.REMAT_PRIMITIVES:
                rid = len(self.remat_calls)
                inner = inner.child(remat=scope.remat + (rid,))
            inner_ops, outs = self.lower_jaxpr(body, consts, in_ids, inner)
            ops.extend(inner_ops)
            if prim in _compat.REMAT_PRIMITIVES:
                self.remat_calls[rid] = RematCall(rid, tuple(in_ids), tuple(outs), dict(eqn.params))
            for var, vid in zip(eqn.outvars, outs, strict=True):
                env[var] = vid
            return

        if prim == "select_n" and self.same_cases(in_ids[1:]):
            env[eqn.outvars[0]] = in_ids[1]
            return
        out_ids = [
            self.new_value(v.aval, f"{module}/{prim}" if module else prim, "intermediate", phase, scope.region)
            for v in eqn.outvars
        ]
        for var, vid in zip(eqn.outvars, out_ids, strict=True):
            env[var] = vid
        source = _compat.source_of(eqn)
        regions: tuple[Region, ...] = ()
        if prim in ("scan", "cond", "while"):
            regions = self.lower_regions(eqn, in_ids, scope.child(phase=phase, module=module))
            rule, linked_in, linked_out = link_rule(self.values, prim, eqn.params, in_ids, out_ids, regions)
            ok = True
        else:
            ctx = RuleContext(
                prim,
                tuple(Shaped(self.values[i].shape, self.values[i].dtype) for i in in_ids),
                tuple(Shaped(self.values[i].shape, self.values[i].dtype) for i in out_ids),
                source,
                self.values[out_ids[0]].name if out_ids else "",
            )
            rule, ok = self.rule(ctx, eqn.params, eqn.primitive)
            linked_in, linked_out = tuple(in_ids), tuple(out_ids)
        if prim == "broadcast_in_dim" and self.values[in_ids[0]].kind == "literal":
            literal = self.values[in_ids[0]]
            self.splats[out_ids[0]] = np.asarray(literal.literal, literal.dtype).tobytes()
        ops.append(
            Op(
                self.n_ops, prim, tuple(in_ids), tuple(out_ids), rule, module, source, phase,
                dict(eqn.params), eqn, regions, linked_in, linked_out, ok, scope.remat,
            )
        )
        self.n_ops += 1

    def same_cases(self, cases: Sequence[int]) -> bool:
        """Whether a ``select_n`` of ``cases`` (not literals) picks one value whatever its
        predicate: XLA has folded it to that value (equal splat constants being one constant) and
        dropped the predicate's ops by the time its propagation runs (jax 0.10.2: the module Shardy
        gets reads the zeros directly). Kept, they linked what XLA does not: ``jax.jvp`` of
        ``zeros.at[i].set(y)`` masks its zero operand by ``select(ids == 0, zeros, zeros)``, where
        ``ids`` (the update ids scattered to find which update wins) took the batch split of the
        result, and the estimate all-reduced them at their gather (corpus moe_ragged, manual_dp:
        1.16x XLA's bytes sent).

        >>> import jax, jax.numpy as jnp
        >>> f = lambda p: jnp.where(p, jnp.zeros(4), jnp.zeros(4)) + 1
        >>> [op.primitive for op in lower(jax.make_jaxpr(f)(jnp.ones(4, bool)), ["p"], ["y"]).ops]
        ['broadcast_in_dim', 'add']
        """
        first = cases[0]
        if self.values[first].kind == "literal":
            return False
        return all(c == first for c in cases) or all(
            self.splats.get(c) is not None and self.splats.get(c) == self.splats.get(first)
            and self.values[c].dtype == self.values[first].dtype for c in cases)

    def lower_region(self, body: Any, role: str, trips: int, scope: "_Scope", names: Sequence[str]) -> Region:
        self.n_regions += 1
        rid = self.n_regions
        jaxpr, consts = _compat.closed_parts(body)
        inner = scope.child(region=rid, remat=())
        in_ids = [
            self.new_value(v.aval, "/".join(p for p in (scope.module, names[i] if i < len(names) else "arg") if p),
                           "region_input", scope.phase or "forward", rid)
            for i, v in enumerate(jaxpr.invars)
        ]
        ops, outs = self.lower_jaxpr(jaxpr, consts, in_ids, inner)
        return Region(rid, tuple(in_ids), tuple(outs), tuple(ops), trips, role)

    def lower_regions(self, eqn: Any, in_ids: list[int], scope: "_Scope") -> tuple[Region, ...]:
        p = eqn.params
        prim = eqn.primitive.name
        if prim == "scan":
            nc, nk = p["num_consts"], p["num_carry"]
            n = len(in_ids)
            names = ["const"] * nc + ["carry"] * nk + ["x"] * (n - nc - nk)
            return (self.lower_region(p["jaxpr"], "body", int(p["length"]), scope, names),)
        if prim == "cond":
            return tuple(self.lower_region(b, "branch", 1, scope, ["arg"] * (len(in_ids) - 1)) for b in p["branches"])
        cond = self.lower_region(p["cond_jaxpr"], "cond", 1, scope, [])
        body = self.lower_region(p["body_jaxpr"], "body", 1, scope, [])
        return (cond, body)


class _Scope:
    __slots__ = ("phase", "module", "region", "remat")

    def __init__(self, phase: Phase | None, module: str, region: int, remat: tuple[int, ...]):
        self.phase, self.module, self.region, self.remat = phase, module, region, remat

    def child(self, **kw: Any) -> "_Scope":
        args = dict(phase=self.phase, module=self.module, region=self.region, remat=self.remat)
        args.update(kw)
        return _Scope(**args)


class _LinkBuilder:
    """Builds the identity-like rule tying a control-flow op's outer values to its regions."""

    def __init__(self, values: Sequence[Value]):
        self.values = values
        self.factors: list[Factor] = []
        self.groups: list[int] = []  # per factor: the tie that made it (axes are unique per tie)
        self.dims: dict[int, tuple[DimFactors, ...]] = {}  # value id -> dims

    def new_factor(self, size: int, kind: str = "parallel", group: int | None = None) -> int:
        self.factors.append(Factor(size, kind))  # type: ignore[arg-type]
        self.groups.append(len(self.groups) if group is None else group)
        return len(self.factors) - 1

    def tie(self, *vids: int, stacked: Sequence[int] = ()) -> None:
        """The values in ``vids`` share factors dim by dim; those in ``stacked`` have a leading
        (blocked) stacking dim in front."""
        base = next((v for v in vids if v not in stacked), None)
        shape = self.values[base].shape if base is not None else self.values[vids[0]].shape[1:]
        # a value tied before (a passthrough carry, an operand used twice) lends its factors
        known = next((self.dims[v] for v in vids if v in self.dims and v not in stacked), None)
        if known is None:
            known = next((self.dims[v][1:] for v in vids if v in self.dims and v in stacked), None)
        shared = list(known) if known is not None else []
        group = self.groups[shared[0][0]] if shared else len(self.groups)
        for size in shape[len(shared):]:
            shared.append((self.new_factor(size, group=group),))
        for v in vids:
            if v in self.dims:
                continue
            if v in stacked:
                layers = self.new_factor(self.values[v].shape[0], "blocked", group=group)
                self.dims[v] = ((layers,),) + tuple(shared)
            else:
                self.dims[v] = tuple(shared)

    def rule(self, linked_in: Sequence[int], linked_out: Sequence[int]) -> FactorRule:
        def get(v: int) -> tuple[DimFactors, ...]:
            if v not in self.dims:  # literals and scalars: no dims of interest
                return tuple(() for _ in self.values[v].shape)
            return self.dims[v]

        return FactorRule(
            tuple(self.factors), tuple(get(v) for v in linked_in), tuple(get(v) for v in linked_out), tuple(self.groups)
        )


def link_rule(values: Sequence[Value], prim: str, p: Any, ins: Sequence[int], outs: Sequence[int],
              regions: tuple[Region, ...]) -> tuple[FactorRule, tuple[int, ...], tuple[int, ...]]:
    """The rule tying a ``scan``/``cond``/``while`` op's operands and results (``ins``, ``outs``)
    to its regions' inputs and outputs (``p``: the op's params), and the values it links."""
    b = _LinkBuilder(values)
    if prim == "scan":
        (body,) = regions
        nc, nk = p["num_consts"], p["num_carry"]
        for i in range(nc):
            b.tie(ins[i], body.inputs[i])
        for j in range(nk):
            b.tie(ins[nc + j], body.inputs[nc + j], body.outputs[j], outs[j])
        for k in range(nc + nk, len(ins)):
            b.tie(ins[k], body.inputs[k], stacked=(ins[k],))
        for m in range(nk, len(outs)):
            b.tie(body.outputs[m], outs[m], stacked=(outs[m],))
        linked_in = tuple(ins) + body.outputs
        linked_out = body.inputs + tuple(outs)
    elif prim == "cond":
        for i in range(1, len(ins)):
            b.tie(ins[i], *(r.inputs[i - 1] for r in regions))
        for j in range(len(outs)):
            b.tie(outs[j], *(r.outputs[j] for r in regions))
        linked_in = tuple(ins) + sum((r.outputs for r in regions), ())
        linked_out = sum((r.inputs for r in regions), ()) + tuple(outs)
    else:  # while
        cond, body = regions
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        for i in range(cn):
            b.tie(ins[i], cond.inputs[i])
        for i in range(bn):
            b.tie(ins[cn + i], body.inputs[i])
        for j in range(len(outs)):
            b.tie(ins[cn + bn + j], cond.inputs[cn + j], body.inputs[bn + j], body.outputs[j], outs[j])
        linked_in = tuple(ins) + body.outputs + cond.outputs
        linked_out = cond.inputs + body.inputs + tuple(outs)
    # a value may appear twice (a passthrough carry); one dims entry serves all its uses
    return b.rule(linked_in, linked_out), linked_in, linked_out


def dead_code_eliminated(ops: list[Op], live: set[int]) -> list[Op]:
    """Drop ops none of whose results is used (XLA would); regions are cleaned inside too.
    ``live`` holds the values used after ``ops`` and grows with what the kept ops use."""
    kept: list[Op] = []
    for op in reversed(ops):
        if not op.regions and not any(v in live for v in op.outputs):
            continue
        if op.regions:
            regions = []
            for r in op.regions:
                inner_live = set(r.outputs)
                body = dead_code_eliminated(list(r.ops), inner_live)
                regions.append(dataclasses.replace(r, ops=tuple(body)))
            op = dataclasses.replace(op, regions=tuple(regions))
        live.update(op.inputs)
        kept.append(op)
    return kept[::-1]


def lower(
    closed_jaxpr: Any,
    input_paths: Sequence[str],
    output_paths: Sequence[str],
    *,
    strict: bool = False,
) -> Program:
    """Lower ``closed_jaxpr`` (e.g. from ``jax.make_jaxpr``) into a Program.

    >>> import jax, jax.numpy as jnp
    >>> cj = jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((4, 8)), jnp.ones((8, 2)))
    >>> lower(cj, ["x", "w"], ["y"]).summary()
    'Program: 2 inputs, 1 outputs, 2 ops (0 regions), 4 values, 2 primitives'
    """
    lw = _Lowering(strict)
    jaxpr = closed_jaxpr.jaxpr
    in_ids = [
        lw.new_value(v.aval, path, "input", "input", 0) for v, path in zip(jaxpr.invars, input_paths, strict=True)
    ]
    ops, outs = lw.lower_jaxpr(jaxpr, closed_jaxpr.consts, in_ids, _Scope(None, "", 0, ()))
    live = set(outs) | {v for call in lw.remat_calls.values() for v in call.outputs}
    ops = dead_code_eliminated(ops, live)
    return Program(
        tuple(lw.values), tuple(ops), tuple(in_ids), tuple(outs), tuple(input_paths), tuple(output_paths),
        lw.remat_calls,
    )
