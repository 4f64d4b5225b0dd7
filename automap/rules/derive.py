"""Factor rules derived from XLA itself, for primitives without a hand-written rule.

Why not JAX's batching rule: ``vmap`` tells where a *new* leading dim goes, but probing an
existing dim means removing it, and then the params that depend on the shape (``axes``,
``permutation``, ``shape``, ``dimension_numbers``...) mean something else; a probe built that
way claims wrong factors. Instead the op is asked, on its own shapes and params, how XLA's SPMD
partitioner splits it:

1. **Seeds.** For each operand dim ``d`` of operand ``i`` (even size), compile the single op
   (``jax.jit`` of ``primitive.bind``, abstract arguments, nothing runs) on a 2-device mesh with
   only that dim sharded. If the compiled program has **no collective** and some result dims of
   the *same size* come out sharded on that axis, those dims and ``(i, d)`` are a candidate
   factor: every device computed its block of those results from its block of the operand and
   whole copies of everything else, so the factor is parallel.
2. **Partners.** The other operands' dims of that size join the factor one at a time, each
   kept only if sharding it too still compiles with no collective and the same results sharded
   (an elementwise op finds all its operands). An operand where more than one dim would fit is
   ambiguous and joins with none.
3. **Together.** The factors are checked together, up to three at a time on a 2x2x2 mesh
   (fewer with fewer devices); one that breaks the others (a collective appears) is dropped.

Everything that no check proved stays whole (a blocked factor per dim). The derived rule never
claims a reduction (sharding a summed dim needs a collective and is rejected) nor a factor that
appears only in results: it can miss parallelism, never invent it. It assumes what holds for
XLA's partitioner: a split that needs no communication 2-way needs none n-way.

Derivation compiles a few tiny programs per distinct (primitive, params, shapes) and is cached.
Primitives with side effects, or that do not compile on this backend, are not derived.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from typing import Any, Mapping

from automap.rules.registry import DimFactors, Factor, FactorRule, RuleContext

_COLLECTIVE = re.compile(
    r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|ragged-all-to-all|collective-permute|"
    r"collective-broadcast)(-start)?\("
)
AXES = ("p0", "p1", "p2")
Where = tuple[int, int]  # (operand or result index, dim)


@dataclasses.dataclass(frozen=True)
class Derivation:
    """A derived rule, or ``None`` and the reason none could be derived."""

    rule: FactorRule | None
    reason: str = ""
    compiles: int = 0


_CACHE: dict[Any, Derivation] = {}


def derive_rule(primitive: Any, ctx: RuleContext, params: Mapping[str, Any]) -> Derivation:
    """The factor rule XLA's partitioner implies for one application of ``primitive``.

    >>> import jax, jax.numpy as jnp
    >>> from automap.rules.registry import RuleContext, Shaped
    >>> f32 = jnp.float32
    >>> ctx = RuleContext("cumsum", (Shaped((4, 6), f32),), (Shaped((4, 6), f32),))
    >>> d = derive_rule(jax.lax.cumsum_p, ctx, {"axis": 1, "reverse": False})
    >>> d.rule.operands, d.rule.results   # the rows share factor 0; the scanned dim stays whole
    ((((0,), (1,)),), (((0,), (2,)),))
    >>> [f.kind for f in d.rule.factors]
    ['parallel', 'blocked', 'blocked']
    """
    try:
        key: Any = (ctx.primitive, ctx.operands, ctx.results, tuple(sorted(params.items())))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    got = _derive(primitive, ctx, params)
    if key is not None:
        _CACHE[key] = got
    return got


def _derive(primitive: Any, ctx: RuleContext, params: Mapping[str, Any]) -> Derivation:
    import jax

    if len(jax.devices()) < 2:
        return Derivation(None, "deriving a rule asks XLA to partition the op, which needs at least 2 devices")
    try:
        probe = _Probe(primitive, ctx, params)
    except Exception as e:  # noqa: BLE001 - any failure to trace means: no derivation
        return Derivation(None, f"it does not trace on its own ({type(e).__name__}: {_first_line(e)})")
    if probe.effects:
        return Derivation(None, f"it has side effects ({', '.join(sorted(map(str, probe.effects)))})")
    try:
        factors = probe.factors()
    except Exception as e:  # noqa: BLE001 - no lowering on this backend, a param tied to another mesh...
        return Derivation(None, f"XLA cannot compile it alone ({type(e).__name__}: {_first_line(e)})",
                          probe.compiles)
    return Derivation(_rule(ctx, factors), "", probe.compiles)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]


class _Probe:
    def __init__(self, primitive: Any, ctx: RuleContext, params: Mapping[str, Any]):
        import jax

        self.ctx = ctx
        self.compiles = 0
        multiple = primitive.multiple_results

        def fn(*xs: Any) -> Any:
            out = primitive.bind(*xs, **params)
            return list(out) if multiple else [out]

        self.fn = fn
        self.avals = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in ctx.operands]
        self.effects = jax.make_jaxpr(fn)(*self.avals).effects
        self.devices = jax.devices()

    @functools.cache
    def mesh(self, n_axes: int) -> Any:
        import jax
        import numpy as np

        devices = np.asarray(self.devices[: 2**n_axes]).reshape((2,) * n_axes)
        return jax.sharding.Mesh(devices, AXES[:n_axes], axis_types=(jax.sharding.AxisType.Auto,) * n_axes)

    def compile(self, placed: Mapping[Where, int]) -> tuple[bool, list[Any], Any]:
        """Compile with operand dims ``placed`` on mesh axes: (collective-free, out shardings, mesh)."""
        import jax
        from jax.sharding import NamedSharding, PartitionSpec as P

        mesh = self.mesh(max(placed.values()) + 1)
        specs = []
        for i, s in enumerate(self.ctx.operands):
            spec = [AXES[placed[(i, d)]] if (i, d) in placed else None for d in range(s.ndim)]
            specs.append(NamedSharding(mesh, P(*spec)))
        self.compiles += 1
        compiled = jax.jit(self.fn, in_shardings=tuple(specs)).lower(*self.avals).compile()
        free = _COLLECTIVE.search(compiled.as_text()) is None
        return free, list(compiled.output_shardings), mesh

    def sharded_results(self, placed: Mapping[Where, int]) -> frozenset[tuple[int, int, int]] | None:
        """``{(result, dim, axis)}`` sharded after placing ``placed``; None if a collective
        appears or a result is sharded in a way a factor cannot say."""
        free, outs, mesh = self.compile(placed)
        if not free:
            return None
        n_axes = max(placed.values()) + 1
        got = set()
        for j, (s, sharding) in enumerate(zip(self.ctx.results, outs, strict=True)):
            found = _read_spec(sharding, s.ndim, mesh, n_axes)
            if found is None:
                return None
            got |= {(j, e, a) for e, a in found}
        return frozenset(got)

    def factors(self) -> list[tuple[list[Where], list[Where]]]:
        """Parallel factors as (operand dims, result dims), checked alone, with partners, together."""
        taken: set[Where] = set()
        found: list[tuple[list[Where], list[Where], frozenset]] = []
        for i, s in enumerate(self.ctx.operands):
            for d, n in enumerate(s.shape):
                if (i, d) in taken or n < 2 or n % 2:
                    continue
                res = self.sharded_results({(i, d): 0})
                if not res or any(self.ctx.results[j].shape[e] != n for j, e, _ in res):
                    continue
                ops = [(i, d)] + self.partners(i, d, n, res, taken)
                taken.update(ops)
                found.append((ops, sorted((j, e) for j, e, _ in res), res))
        return [(ops, res) for ops, res, _ in self.together(found)]

    def partners(self, i: int, d: int, n: int, res: frozenset, taken: set[Where]) -> list[Where]:
        out = []
        for k, s in enumerate(self.ctx.operands):
            if k == i:
                continue
            fits = [(k, f) for f, m in enumerate(s.shape) if m == n and (k, f) not in taken
                    and self.sharded_results({(i, d): 0, (k, f): 0}) == res]
            if len(fits) == 1:
                out += fits
        return out

    def together(self, found: list) -> list:
        """Keep the factors that still need no collective when sharded together (greedy, in
        chunks of as many axes as the devices allow)."""
        n_axes = min(len(AXES), int(math.log2(len(self.devices))))
        if n_axes < 2 or len(found) < 2:
            return found
        kept: list = []
        for chunk_start in range(0, len(found), n_axes):
            chunk: list = []
            for f in found[chunk_start:chunk_start + n_axes]:
                trial = chunk + [f]
                placed = {w: a for a, (ops, _, _) in enumerate(trial) for w in ops}
                want = frozenset((j, e, a) for a, (_, _, res) in enumerate(trial) for j, e, _ in res)
                if len(trial) == 1 or self.sharded_results(placed) == want:
                    chunk = trial
            kept += chunk
        return kept


def _read_spec(sharding: Any, ndim: int, mesh: Any, n_axes: int) -> list[tuple[int, int]] | None:
    """``[(dim, axis)]`` of a compiled output sharding whose dims each hold at most one axis."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    if ndim == 0:
        return []
    for assignment in itertools.product(range(-1, ndim), repeat=n_axes):  # axis a -> dim, -1: unused
        used = [e for e in assignment if e >= 0]
        if len(used) != len(set(used)):
            continue
        spec = [None] * ndim
        for a, e in enumerate(assignment):
            if e >= 0:
                spec[e] = AXES[a]
        if sharding.is_equivalent_to(NamedSharding(mesh, P(*spec)), ndim):
            return [(e, a) for a, e in enumerate(assignment) if e >= 0]
    return None


def _rule(ctx: RuleContext, found: list[tuple[list[Where], list[Where]]]) -> FactorRule:
    """Parallel factors where found, one blocked factor for every other dim of size > 1."""
    factors: list[Factor] = []
    ops: list[list[DimFactors]] = [[() for _ in s.shape] for s in ctx.operands]
    res: list[list[DimFactors]] = [[() for _ in s.shape] for s in ctx.results]
    for op_dims, res_dims in found:
        i, d = op_dims[0]
        factors.append(Factor(ctx.operands[i].shape[d]))
        for k, f in op_dims:
            ops[k][f] = (len(factors) - 1,)
        for j, e in res_dims:
            res[j][e] = (len(factors) - 1,)
    for values, dims in ((ctx.operands, ops), (ctx.results, res)):
        for s, vdims in zip(values, dims, strict=True):
            for d, n in enumerate(s.shape):
                if not vdims[d] and n > 1:
                    factors.append(Factor(n, "blocked"))
                    vdims[d] = (len(factors) - 1,)
    return FactorRule(tuple(factors), tuple(map(tuple, ops)), tuple(map(tuple, res)))
