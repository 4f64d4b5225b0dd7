"""A sharding plan: :class:`Plan`, what :func:`automap.automap` plans for one abstract signature of a
function on one mesh (its layout, estimate, shardings, report, save/load, argument checks)."""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Mapping, Sequence

import jax
from jax import tree_util
from jax.sharding import Mesh, NamedSharding

from automap import emit
from automap.ir.program import Program
from automap.arg_styles import ArgStyles
from automap.propagate import Reshard, reshards
from automap.report import format_report
from automap.shardings import ShardingState, Spec
from automap.trace import Traced


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A sharding plan for one abstract signature of a function on one mesh."""

    mesh: Mesh
    traced: Traced
    program: Program
    state: ShardingState
    pins: frozenset[int]
    out_specs: tuple[Spec, ...]  # flat, after tying fed-back outputs to their inputs
    notes: tuple[str, ...] = ()
    reasons: Mapping[int, str] = dataclasses.field(default_factory=dict)  # input value id -> why
    topology: Any = None  # automap.cost.Topology used by .estimate (None: from the backend)
    donated: frozenset[int] = frozenset()  # input value ids whose buffers are donated
    # XLA's measure of the compiled program(s), filled by the first call ("arbitration": automap.arbiter)
    measured: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:  # a copy (dataclasses.replace) measures its own programs
        object.__setattr__(self, "measured", dict(self.measured))
        object.__setattr__(self, "_layouts", {})

    @property
    def xla_lays_out(self) -> bool:
        """Whether the compiled program's intermediates are laid out as :mod:`automap.xla_layout`
        models XLA's propagation: nothing is pinned, or the arbiter kept the inputs-only program
        (:mod:`automap.arbiter`); a loop's carry as Shardy's data-flow edges lay it out
        (:mod:`automap.xla_loops`)."""
        arbitration = self.measured.get("arbitration")
        return not self.pins or (arbitration is not None and arbitration.kept.name == "inputs-only")

    def _of_layout(self, what: str, compute: Callable[[], Any]) -> Any:
        """``compute()`` once per layout: :attr:`xla_lays_out` can change when the first call
        arbitrates, so what depends on the layout is cached under it."""
        key = (what, self.xla_lays_out)
        if key not in self._layouts:
            self._layouts[key] = compute()
        return self._layouts[key]

    @property
    def layout(self) -> ShardingState:
        """The layout of the compiled program, which :attr:`estimate` prices: the plan's own where
        it is pinned, else the layout XLA's propagation gives from the plan's input and output specs
        (:func:`automap.xla_layout.xla_layout`)."""
        from automap.xla_layout import xla_layout

        return self._of_layout("layout", lambda: xla_layout(self.state) if self.xla_lays_out else self.state)

    @property
    def estimate(self) -> Any:
        """The cost model's :class:`~automap.cost.Estimate` of this plan's :attr:`layout`
        (nothing is compiled)."""
        from automap.cost import default_topology, estimate

        return self._of_layout("estimate", lambda: estimate(self.layout, self.topology or default_topology(),
                                                            donated=self.donated))

    @property
    def in_shardings(self) -> Any:
        """A pytree of ``NamedSharding`` matching the (non-static) arguments."""
        leaves = emit.shardings(self.state, self.mesh, self.program.inputs)
        return tree_util.tree_unflatten(self.traced.in_tree, leaves)

    @property
    def out_shardings(self) -> Any:
        """A pytree of ``NamedSharding`` matching the outputs."""
        return tree_util.tree_unflatten(self.traced.out_tree, self._flat_out_shardings())

    def _flat_out_shardings(self) -> list[NamedSharding]:
        from automap.shardings import to_partition_spec

        return [NamedSharding(self.mesh, to_partition_spec(s)) for s in self.out_specs]

    @property
    def reshards(self) -> tuple[Reshard, ...]:
        """The collectives the plan implies, op by op (what the cost model prices)."""
        return self._of_layout("reshards", lambda: tuple(reshards(self.layout)))

    def report(self, full: bool = False) -> str:
        """What the plan costs (estimate, implied collectives), then per input its shape, spec,
        bytes per device and why. Optimizer state that mirrors its parameters and identical
        layers are folded into one row each; ``full=True`` lists every leaf.

        >>> import jax.numpy as jnp, automap
        >>> plan = automap.partition(lambda x: x * 2, mesh=automap.make_mesh({"data": 2}), search=None).plan(jnp.ones((8, 4)))
        >>> print(plan.report().splitlines()[4])
          x      (8, 4)  float32  (data, -)  64 B          batch dim over data
        """
        return format_report(self, full)

    def verify(self, compiled: Any, *, warn: bool = True) -> Any:
        """Hold ``compiled`` (this plan's compiled program) against :attr:`estimate`: a
        :class:`~automap.verify.Fidelity` (``print`` it for the table); warns with a
        :class:`~automap.verify.FidelityWarning` where a figure is off target."""
        from automap.verify import verify

        return verify(self, compiled, warn=warn)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable hash of the planned program's structure (see :mod:`automap.plan_io`)."""
        from automap.plan_io import fingerprint

        return fingerprint(self.program)

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan to ``path`` as JSON (format: :mod:`automap.plan_io`).

        >>> import os, tempfile, jax.numpy as jnp, automap
        >>> plan = automap.partition(jnp.tanh, mesh=automap.make_mesh({"data": 2})).plan(jnp.ones((8, 4)))
        >>> plan.save(os.path.join(tempfile.mkdtemp(), "plan.json"))
        """
        from automap.plan_io import save

        save(self, path)

    @staticmethod
    def load(
        path: str | os.PathLike, mesh: Mesh, fn: Callable | None = None, args: Sequence[Any] | None = None,
        **options: Any,
    ) -> Any:
        """Load a plan file for ``mesh`` (checked now); with ``fn`` and ``args``, the Plan for them.

        Without ``fn``, a :class:`~automap.plan_io.StoredPlan` to pass as ``plan=`` to
        :func:`automap` (checked against the function's fingerprint on its first call). With ``fn``
        and ``args`` (``options``: ``static_argnums``, ``donate_argnums``, ``strict``,
        ``topology``), the function is traced, checked, and the stored specs are set.
        A different mesh, function or shapes raise :class:`~automap.plan_io.PlanMismatchError`
        naming what changed.

        >>> import os, tempfile, jax.numpy as jnp, automap
        >>> mesh = automap.make_mesh({"data": 2})
        >>> path = os.path.join(tempfile.mkdtemp(), "plan.json")
        >>> automap.partition(jnp.tanh, mesh=mesh).plan(jnp.ones((8, 4))).save(path)
        >>> Plan.load(path, mesh, jnp.tanh, (jnp.ones((8, 4)),)).in_shardings[0].spec
        P('data',)
        """
        from automap.plan_io import StoredPlan

        stored = StoredPlan.load(path, mesh)
        if fn is None:
            return stored
        if args is None:
            raise TypeError("Plan.load(path, mesh, fn) needs args too: pass args=(example arguments...)")
        styles = ArgStyles.split(tuple(args), options.get("static_argnums", ()))
        # nnx objects and static leaves: the plan is of the pure function of the arrays
        return stored.build(styles.pure_fn(fn, []), styles.pure_args, **options)

    def check_args(self, args: Sequence[Any], static_argnums: Sequence[int] = ()) -> list[Any]:
        """Flatten ``args`` and check them against the plan's structure, shapes and dtypes."""
        static = set(static_argnums)
        dynamic = tuple(a for i, a in enumerate(args) if i not in static)
        leaves, tree = tree_util.tree_flatten(dynamic)
        if tree != self.traced.in_tree:
            raise ValueError(
                f"arguments do not have the structure the plan was made for: {_structure_diff(self.traced, dynamic)}\n"
                f"  plan:  {self.traced.in_tree}\n  given: {tree}\n"
                "pass arguments of the planned structure, or replan for these (call .plan(*args) on a "
                "function without a fixed plan=)"
            )
        for path, leaf, aval in zip(self.program.input_paths, leaves, self.traced.in_avals, strict=True):
            shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
            if dtype is not None and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
                dtype = jax.numpy.dtype(dtype)
            if shape != tuple(aval.shape) or (dtype is not None and dtype != aval.dtype):
                raise ValueError(
                    f"argument '{path}' has shape {shape} and dtype {dtype}, but the plan was made for "
                    f"{tuple(aval.shape)} {aval.dtype}; pass an argument of the planned shape and dtype, or "
                    "replan for the new ones (call .plan(*args) on a function without a fixed plan=)"
                )
        return leaves


def _structure_diff(traced: Traced, dynamic: Sequence[Any]) -> str:
    """Which input paths are missing or unexpected in ``dynamic`` compared with the plan."""
    from automap.trace import leaf_paths, path_str

    names = traced.arg_names
    if len(dynamic) != len(names):
        return f"the plan takes {len(names)} arguments ({', '.join(names)}), got {len(dynamic)}"
    given = [path_str(names[p[0].idx], p[1:]) for p in leaf_paths(tuple(dynamic))]
    missing = [p for p in traced.in_paths if p not in set(given)]
    extra = [p for p in given if p not in set(traced.in_paths)]
    parts = []
    if missing:
        parts.append("missing " + ", ".join(repr(p) for p in missing))
    if extra:
        parts.append("unexpected " + ", ".join(repr(p) for p in extra))
    return "; ".join(parts) or "same paths, different container types"
