"""The partitioning IR: values, ops and regions.

A :class:`Program` is a flat list of :class:`Op` over :class:`Value` s. Nested calls (jit,
custom_jvp/vjp, remat, name) are inlined by :mod:`automap.ir.lower`; ``scan``, ``cond`` and
``while`` keep their bodies as :class:`Region` s attached to their op. Every op carries the
factor rule of its primitive. For ``scan``/``cond``/``while`` the rule *links* the outer operands
and results to the region's inputs and outputs (``Op.linked_inputs`` / ``linked_outputs``), so
propagation treats a loop exactly like any other op and analyses its body once.

Value ids are unique across all regions of a program.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, Literal, Mapping, Sequence, TypeVar

import numpy as np

from automap.rules.registry import FactorRule

_T = TypeVar("_T")

Phase = Literal["input", "forward", "backward", "optimizer"]
ValueKind = Literal["input", "intermediate", "literal", "const", "region_input"]


@dataclasses.dataclass(frozen=True, eq=False)
class Value:
    id: int
    shape: tuple[int, ...]
    dtype: np.dtype
    name: str
    kind: ValueKind
    phase: Phase
    itemsize: int
    region: int = 0  # 0: top level; else the id of the Region that defines it
    literal: Any = None  # the Python/numpy value of a literal or a const

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def __repr__(self) -> str:
        dims = ",".join(map(str, self.shape))
        return f"Value(#{self.id} {self.name} {self.dtype}[{dims}])"


@dataclasses.dataclass(frozen=True, eq=False)
class Region:
    """A body analysed once and run ``trips`` times per execution of its op."""

    id: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    ops: tuple["Op", ...]
    trips: int = 1
    role: str = "body"  # "body" | "branch" | "cond"


@dataclasses.dataclass(frozen=True, eq=False)
class Op:
    id: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    rule: FactorRule
    name: str  # module path from the name stack, e.g. "GPT/blocks_0/attn"
    source: str  # "file.py:12 (fn)"
    phase: Phase
    params: Mapping[str, Any]
    eqn: Any = None  # the JaxprEqn it came from (replayed by emission)
    regions: tuple[Region, ...] = ()
    linked_inputs: tuple[int, ...] = ()  # values the rule's operands refer to
    linked_outputs: tuple[int, ...] = ()  # values the rule's results refer to
    has_rule: bool = True  # False: the replicate-around default was used
    remat: tuple[int, ...] = ()  # ids of the enclosing inlined remat calls, outermost first

    def __repr__(self) -> str:
        return f"Op(#{self.id} {self.primitive} {self.name} in={self.inputs} out={self.outputs})"

    @functools.cached_property
    def linked(self) -> tuple[int, ...]:
        """Every value the rule refers to: ``linked_inputs + linked_outputs``."""
        return self.linked_inputs + self.linked_outputs

    @functools.cached_property
    def links_distinct(self) -> bool:
        """Whether no value is linked twice (``x * x`` links ``x`` twice)."""
        return len(set(self.linked)) == len(self.linked)

    def loop_constants(self) -> tuple[int, ...]:
        """The body inputs of a ``scan``/``while`` that hold its constant operands, the same on
        every trip (``()`` for any other op)."""
        if self.primitive == "scan":
            return self.regions[0].inputs[: self.params["num_consts"]]
        if self.primitive == "while":
            return self.regions[1].inputs[: self.params["body_nconsts"]]
        return ()

    @functools.cached_property
    def unread_operands(self) -> frozenset[int]:
        """The operands of a ``scan`` that its body never reads (constants or stacked inputs whose
        body input no body op, nested ones included, nor body output reads; a value passed twice
        counts only if no copy is read): XLA's while-loop simplifier drops such an element of the
        loop state, and then the value that only fed it (the memory estimate holds no buffer for
        it). JAX leaves them in a scan's gradient: a loop-invariant residual hoisted out of the
        forward scan (``jnp.where(mask, s, finfo.min)``'s splat, f32[batch, heads, seq, seq] in
        equinox's attention) that the backward scan is passed but does not read. Empty for any
        other op.

        >>> import jax, jax.numpy as jnp
        >>> from automap.ir.lower import lower
        >>> mask = jnp.tril(jnp.ones((4, 4), bool))
        >>> def loss(ws, x):
        ...     layer = lambda h, w: (jax.nn.softmax(jnp.where(mask, h @ w @ h.T, -1e9)) @ h, None)
        ...     return jax.lax.scan(layer, x, ws)[0].sum()
        >>> prog = lower(jax.make_jaxpr(jax.grad(loss))(jnp.ones((2, 3, 3)), jnp.ones((4, 3))), ["ws", "x"], ["g"])
        >>> [[prog.values[v].shape for v in op.unread_operands] for op in prog.ops if op.primitive == "scan"]
        [[], [(4, 4)]]
        """
        if self.primitive != "scan":
            return frozenset()
        (body,) = self.regions
        nc, nk = self.params["num_consts"], self.params["num_carry"]
        read = set(body.outputs)
        stack = list(body.ops)
        while stack:
            op = stack.pop()
            read.update(op.inputs)
            stack.extend(o for r in op.regions for o in r.ops)
        pairs = list(zip(self.inputs, body.inputs))
        unread = {v for k, (v, inner) in enumerate(pairs) if not nc <= k < nc + nk and inner not in read}
        return frozenset(unread - {v for v, inner in pairs if inner in read})

    def loop_backedges(self) -> dict[int, int]:
        """Region input -> the body output fed back into it on the next trip, for the carries of a
        ``scan``/``while`` (``{}`` for any other op).

        >>> import jax, jax.numpy as jnp
        >>> from automap.ir.lower import lower
        >>> f = lambda w, xs: jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), xs[0], xs)[0]
        >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((3, 4))), ["w", "xs"], ["y"])
        >>> (scan,) = [op for op in prog.ops if op.primitive == "scan"]
        >>> len(scan.loop_constants()), len(scan.loop_backedges())  # w; the carry h
        (1, 1)
        """
        if self.primitive == "scan":
            (body,) = self.regions
            nc, nk = self.params["num_consts"], self.params["num_carry"]
            return {body.inputs[nc + j]: body.outputs[j] for j in range(nk)}
        if self.primitive == "while":
            cond, body = self.regions
            cn, bn = self.params["cond_nconsts"], self.params["body_nconsts"]
            back = {body.inputs[bn + j]: out for j, out in enumerate(body.outputs)}
            return back | {cond.inputs[cn + j]: out for j, out in enumerate(body.outputs)}
        return {}


@dataclasses.dataclass(frozen=True)
class RematCall:
    """An inlined ``remat``/``checkpoint`` call; emission wraps its ops in ``jax.checkpoint`` again."""

    id: int
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any]


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
    """A lowered function: ``inputs``/``outputs`` are value ids in flattened pytree order."""

    values: tuple[Value, ...]  # indexed by id
    ops: tuple[Op, ...]  # top-level ops in program order
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    input_paths: tuple[str, ...]
    output_paths: tuple[str, ...]
    remat_calls: Mapping[int, RematCall] = dataclasses.field(default_factory=dict)
    recomputed: tuple[str, ...] = ()  # blocks whose residuals the backward recomputes (ir/recompute.py)
    copies: Mapping[int, int] = dataclasses.field(default_factory=dict)  # recomputed value -> its original
    dropped_remat: int = 0  # user remat calls dropped, their recomputation matched to the forward (ir/unremat.py)
    memo: dict = dataclasses.field(default_factory=dict, repr=False)  # derived data, e.g. per-op costs

    def value(self, vid: int) -> Value:
        return self.values[vid]

    def memo_of(self, ops: Sequence[Op], key: tuple, compute: Callable[[], _T]) -> _T:
        """``compute()``, derived from ``ops`` (the program's op tuple or a region's), memoised
        under ``key`` for as long as that very tuple is the one asked about (a list of ops, made
        for one call, is computed afresh).

        >>> import jax, jax.numpy as jnp
        >>> from automap.ir.lower import lower
        >>> prog = lower(jax.make_jaxpr(lambda x: jnp.tanh(x) * 2)(jnp.ones(4)), ["x"], ["y"])
        >>> count = lambda: len(prog.ops)
        >>> prog.memo_of(prog.ops, ("count",), count), prog.memo_of(prog.ops, ("count",), lambda: -1)  # the memo
        (2, 2)
        """
        full = (key, id(ops))
        got = self.memo.get(full)
        if got is not None and got[0] is ops:
            return got[1]
        out = compute()
        if isinstance(ops, tuple):
            self.memo[full] = (ops, out)
        return out

    def walk(self) -> Iterator[tuple[Op, int]]:
        """Every op, nested regions included (after their op), with its trip multiplier."""
        return iter(self.walked)

    @functools.cached_property
    def walked(self) -> tuple[tuple[Op, int], ...]:
        """:meth:`walk`, computed once."""

        def rec(ops: tuple[Op, ...], mult: int) -> Iterator[tuple[Op, int]]:
            for op in ops:
                yield op, mult
                for region in op.regions:
                    yield from rec(region.ops, mult * region.trips)

        return tuple(rec(self.ops, 1))

    @functools.cached_property
    def all_ops(self) -> tuple[Op, ...]:
        return tuple(op for op, _ in self.walked)

    @functools.cached_property
    def users(self) -> Mapping[int, tuple[Op, ...]]:
        """value id -> ops whose rule refers to it (as operand or result), in program order."""
        out: dict[int, list[Op]] = {}
        for op in self.all_ops:
            for vid in dict.fromkeys(op.linked):
                out.setdefault(vid, []).append(op)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def users_of(self) -> tuple[tuple[Op, ...], ...]:
        """:attr:`users` as a tuple indexed by value id (no users: an empty tuple)."""
        users = self.users
        return tuple(users.get(v, ()) for v in range(len(self.values)))

    def primitives(self) -> set[str]:
        return {op.primitive for op in self.all_ops}

    def summary(self) -> str:
        ops = self.all_ops
        n_regions = sum(len(op.regions) for op in ops)
        return (
            f"Program: {len(self.inputs)} inputs, {len(self.outputs)} outputs, {len(ops)} ops "
            f"({n_regions} regions), {len(self.values)} values, {len(self.primitives())} primitives"
        )
