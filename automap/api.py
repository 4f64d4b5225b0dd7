"""The public API: ``automap.automap`` / ``automap.partition`` and :class:`Partitioned` (the plan it makes:
:class:`automap.plan.Plan`)."""
from __future__ import annotations

import functools
import os
from typing import Any, Callable, Mapping, Sequence

import jax
from jax import tree_util
from jax.sharding import Mesh, NamedSharding

from automap import _compat, emit
from automap.arbiter import Arbiter, affordable, arbitrate
from automap.arg_styles import ArgStyles
from automap.call_args import ArgumentBinder
from automap.options import (check_argnums, check_argnums_in_range, check_flag, check_memory_budget, check_pins,
                             tactic_list)
from automap.placement import dispatch_key, on_mesh, place, placed_call
from automap.plan import Plan
from automap.trace import abstractify, arg_names, trace


def make_mesh(axes: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A device mesh with ``AxisType.Auto`` axes, e.g. ``make_mesh({"data": 2, "model": 4})``.

    >>> mesh = make_mesh({"data": 1})
    >>> dict(mesh.shape)
    {'data': 1}
    """
    names = tuple(axes)
    for n in names:
        size = axes[n]
        if not isinstance(size, (int,)) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis {n!r} has size {size!r}: every mesh axis size must be an integer >= 1")
    shape = tuple(int(axes[n]) for n in names)
    need = 1
    for s in shape:
        need *= s
    available = len(devices) if devices is not None else jax.device_count()
    if need > available:
        raise ValueError(
            f"mesh {dict(axes)} needs {need} devices but {available} are available; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={need} before importing jax"
        )
    return _compat.auto_mesh(shape, names, devices)


class Partitioned:
    """A function planned and compiled for a mesh; see :func:`automap`."""

    def __init__(
        self,
        fn: Callable,
        *,
        mesh: Mesh,
        tactics: Sequence[Any] | None = None,
        search: Any = "auto",
        memory_budget: int | str | None = None,
        topology: Any = None,
        donate_argnums: Sequence[int] = (),
        static_argnums: Sequence[int] = (),
        static_argnames: str | Sequence[str] | None = None,
        strict: bool = False,
        pins: emit.PinPolicy = "plan",
        plan: Plan | Any | str | os.PathLike | None = None,
        arbiter: Arbiter = "auto",
        keep_user_remat: bool = False,
    ):
        from automap.plan_io import StoredPlan

        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (see automap.make_mesh), got {type(mesh).__name__}")
        if isinstance(plan, (str, os.PathLike)):
            plan = StoredPlan.load(plan, mesh)
        if isinstance(plan, StoredPlan):
            plan.check_mesh(mesh)
            self._stored: StoredPlan | None = plan
            plan = None
        else:
            self._stored = None
        if plan is not None and plan.mesh != mesh:
            raise ValueError(
                f"the plan was made for mesh {dict(plan.mesh.shape)} but mesh {dict(mesh.shape)} was given; "
                "pass mesh=plan.mesh, or replan on this mesh (leave out plan=)"
            )
        self.fn = fn
        self.mesh = mesh
        self._emit_mesh = _compat.auto_view(mesh)  # Explicit axes: plan and run on an Auto view
        self.tactics = tactic_list(tactics, mesh)
        if not (search is None or search == "auto" or callable(getattr(search, "search", None))):
            raise TypeError(
                f"search must be a searcher (search.MCTS(), search.Greedy(), search.ILP()), 'auto' or None, "
                f"got {search!r}"
            )
        check_memory_budget(memory_budget)
        check_pins(pins)
        self.search = search
        self.memory_budget = memory_budget
        self.topology = topology
        self.donate_argnums = check_argnums("donate_argnums", donate_argnums)
        self._binder = ArgumentBinder(fn, check_argnums("static_argnums", static_argnums), static_argnames)
        self.static_argnums = self._binder.static_argnums  # static_argnames joined by position
        self.strict = strict
        self.pins = pins
        self.keep_user_remat = check_flag("keep_user_remat", keep_user_remat)
        if arbiter not in ("auto", "always", "search", None):
            raise ValueError(f"arbiter must be 'auto', 'always', 'search' or None, got {arbiter!r}")
        self.arbiter = arbiter
        self._fixed_plan = plan
        self._plans: dict[Any, Plan] = {}
        self._compiled: dict[Any, Any] = {}
        self._out_static: dict[Any, list] = {}  # plan key -> [static part of the outputs]
        self._placements: dict[int, list[NamedSharding]] = {}  # id(plan) -> its input leaves' shardings
        self._dispatch: dict[Any, Callable] = {}  # arguments' structure, shapes, dtypes -> the compiled call
        functools.update_wrapper(self, fn)

    # -- planning ------------------------------------------------------------------------------
    def _signature(self, args: Sequence[Any]) -> Any:
        check_argnums_in_range("static_argnums", self.static_argnums, len(args))
        check_argnums_in_range("donate_argnums", self.donate_argnums, len(args))
        for i in self.static_argnums:
            try:
                hash(args[i])
            except TypeError:
                raise TypeError(
                    f"static argument {i} must be hashable, got {type(args[i]).__name__} {args[i]!r}; pass a "
                    "tuple instead of a list, or make it a dynamic argument"
                ) from None
        static = tuple((i, args[i]) for i in self.static_argnums)
        dynamic = tuple(a for i, a in enumerate(args) if i not in set(self.static_argnums))
        leaves, tree = tree_util.tree_flatten(dynamic)
        avals = tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)
        return static, tree, avals

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """Plan for these arguments (arrays or ``jax.ShapeDtypeStruct``); runs nothing.

        flax nnx objects among the arguments are planned as their state, non-array leaves
        (equinox Modules' functions and ints) are static (see :mod:`automap.arg_styles`).
        """
        with _compat.planning_mesh_context(self.mesh):
            return self._prepare(self._binder.bind(args, kwargs))[2]

    def _prepare(self, args: Sequence[Any]) -> tuple[ArgStyles, tuple[Any, ...], Plan, list]:
        """(the split arguments, the pure arguments, their plan, the static part of its outputs)."""
        styles = ArgStyles.split(args, self.static_argnums, arg_names(self.fn, len(args), ()))
        pure = styles.pure_args
        key = (self._signature(pure), styles.key)
        out_static = self._out_static.setdefault(key, [])
        if self._fixed_plan is not None:
            self._fixed_plan.check_args(pure, self.static_argnums)
            if not out_static:  # planned elsewhere: trace once for the static part of the outputs
                trace(styles.pure_fn(self.fn, out_static), pure, static_argnums=self.static_argnums)
            return styles, pure, self._fixed_plan, out_static
        if key not in self._plans:
            from automap.planner import make_plan

            fn = styles.pure_fn(self.fn, out_static)
            options = dict(static_argnums=self.static_argnums, strict=self.strict, topology=self.topology,
                           donate_argnums=self.donate_argnums)
            if self._stored is not None:  # a plan file: trace, check, set the stored specs
                self._plans[key] = self._stored.build(fn, pure, **options)
            else:
                self._plans[key] = make_plan(
                    fn, pure, self.mesh, tactics=self.tactics, pins=self.pins, search=self.search,
                    memory_budget=self.memory_budget, arbiter=self.arbiter, keep_user_remat=self.keep_user_remat,
                    **options,
                )
        plan = self._plans[key]
        return styles, pure, plan, out_static

    def _jitted(self, plan: Plan, args: Sequence[Any]) -> tuple[Any, Any]:
        """(the jax.jit function, its Compiled or None) of the plan's program; with the arbiter on,
        the better of the pinned and the inputs-only program by XLA's measure (automap.arbiter)."""
        if id(plan) not in self._compiled:
            dynamic = [i for i in range(len(plan.traced.arg_names) + len(self.static_argnums)) if i not in set(self.static_argnums)]
            donated_args = {dynamic.index(i) for i in self.donate_argnums if i in dynamic}
            donate = tuple(k for k, a in enumerate(plan.traced.leaf_arg) if a in donated_args)

            def program(pins: frozenset[int]) -> Callable[[], Any]:
                outs = [NamedSharding(self._emit_mesh, s.spec) for s in plan._flat_out_shardings()]
                return lambda: emit.compile_plan(plan.state, self._emit_mesh, pins=pins, out_specs=outs,
                                                 donate_argnums=donate)

            if not plan.pins or not affordable(self.arbiter, plan.program):  # no pins: jax.jit's own program
                self._compiled[id(plan)] = (program(plan.pins)(), None)
            else:
                candidates = {"pinned": program(plan.pins), "inputs-only": program(frozenset())}
                # a plan that decided nothing past its inputs (pinned only for its loops) is what
                # jax.jit makes of the same in_shardings: it may not trade one figure for the other
                # against that program; a plan that decided intermediates keeps its own in a trade
                reference = None if emit.decided_values(plan.state) else "inputs-only"
                arbitration = arbitrate(candidates, [abstractify(x) for x in args], reference=reference,
                                        budget=self._budget_bytes())
                plan.measured["arbitration"] = arbitration
                self._compiled[id(plan)] = (arbitration.kept.jitted, arbitration.kept.compiled)
        return self._compiled[id(plan)]

    def _budget_bytes(self) -> int | None:
        """The user's memory budget in bytes per device (None without one)."""
        from automap.cost import parse_bytes
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """The ``jax.stages.Lowered`` of exactly what ``__call__`` runs."""
        with _compat.planning_mesh_context(self.mesh):
            _, pure, plan, _ = self._prepare(self._binder.bind(args, kwargs))
            leaves = plan.check_args(pure, self.static_argnums)
            abstract = [abstractify(x) for x in leaves]
            return self._jitted(plan, abstract)[0].lower(*abstract)

    def verify(self, *args: Any, warn: bool = True, **kwargs: Any) -> Any:
        """Compile what ``__call__`` runs for these arguments and hold it against the plan's
        estimate (:meth:`Plan.verify`)."""
        return self.plan(*args, **kwargs).verify(self.lower(*args, **kwargs).compile(), warn=warn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:  # a training loop feeding a step's outputs back: jax.jit's own dispatch
            leaves, tree = tree_util.tree_flatten(args)
            fast = self._dispatch.get(dispatch_key(tree, leaves))
            if fast is not None:
                try:
                    return fast(leaves)
                except (TypeError, ValueError, RuntimeError):  # e.g. a donated argument: the full path says why
                    pass
        with _compat.planning_mesh_context(self.mesh):  # a caller's jax.set_mesh: its Auto view
            styles, pure, plan, out_static = self._prepare(self._binder.bind(args, kwargs))  # keywords bound
            leaves = plan.check_args(pure, self.static_argnums)
            shardings = self._in_shardings(plan)
            placed = [place(x, s, path) for x, s, path in zip(leaves, shardings, plan.program.input_paths, strict=True)]
            jitted, compiled = self._jitted(plan, placed)
            outs = on_mesh((compiled or jitted)(*placed), self.mesh)
        self._remember_dispatch(args, kwargs, styles, leaves, plan, compiled or jitted, out_static)
        result = tree_util.tree_unflatten(plan.traced.out_tree, outs)
        return styles.finish(result, out_static[0])  # static outputs put back, nnx objects updated in place

    def _in_shardings(self, plan: Plan) -> list[NamedSharding]:
        if id(plan) not in self._placements:
            self._placements[id(plan)] = emit.shardings(plan.state, self._emit_mesh, plan.program.inputs)
        return self._placements[id(plan)]

    def _remember_dispatch(self, args, kwargs, styles, leaves, plan, run, out_static) -> None:
        """After a call whose arguments were arrays alone (nothing static, no nnx object): the next
        call with the same structure, shapes and dtypes places its arguments and runs the compiled
        program without planning's checks (a training loop's per-step cost, as ``jax.jit``'s)."""
        if kwargs or self.static_argnums or styles.graph is not None or len(self._dispatch) >= _DISPATCH_ENTRIES:
            return
        flat, tree = tree_util.tree_flatten(args)
        if len(flat) != len(leaves) or any(x is not f for x, f in zip(leaves, flat)):
            return
        key = dispatch_key(tree, flat)
        if key is None:
            return
        static = out_static[0]
        finish = functools.partial(styles.finish, out_static=static) if tree_util.tree_leaves(static) else None
        direct = not self.donate_argnums and self._emit_mesh is self.mesh
        self._dispatch[key] = placed_call(run, self._in_shardings(plan), plan.program.input_paths, self.mesh,
                                          plan.traced.out_tree, finish, direct=direct)


_DISPATCH_ENTRIES = 64  # structures / shapes remembered per function


def automap(fn: Callable | None = None, *, mesh: Mesh, **options: Any) -> Any:
    """Partition ``fn`` over ``mesh`` automatically; use as ``@automap.automap(mesh=mesh)``.

    Keywords: ``tactics`` (a list of tactics applied in order), ``search`` (default ``"auto"``:
    with no tactics, ``search.MCTS()`` over every mesh axis, minimising the estimated step time
    under ``memory_budget``, which defaults to the topology's device memory; with tactics, a
    search fills the mesh axes they leave unused; ``None``: no search, and without tactics the
    batch is sharded over every mesh axis that divides it), ``memory_budget``, ``topology``,
    ``donate_argnums``, ``static_argnums``, ``static_argnames`` (as ``jax.jit``; keyword arguments
    of a call are bound to positions, see :mod:`automap.call_args`), ``strict`` (error on primitives
    without a rule), ``pins`` (which intermediates get sharding constraints, default ``"plan"``: those whose
    layout the plan decided, see :func:`automap.emit.pinned_values`), ``arbiter`` (``"auto"``, the
    default: for a small program the search's final candidates are compiled and measured, and the
    answer is one no expert composition XLA measured beats in both bytes sent and memory; a program
    with pins is compiled inputs-only too and the better by XLA's measure kept, see
    :mod:`automap.arbiter`; ``None``: the pinned program, the search's answer by estimate;
    ``"always"``: as ``"auto"`` at any size; ``"search"``: as ``"auto"``), ``plan`` (a fixed Plan, or a plan
    file's path / :meth:`Plan.load` result: no tactics or search run, the stored specs are used
    after checking the function's fingerprint and the mesh), ``keep_user_remat`` (default False:
    the search may drop the function's own ``jax.checkpoint``/``nn.remat`` when its plan is better
    without it by the one objective, e.g. faster with memory to spare, or with selective
    recomputation in its place, and the plan's notes and report say so
    (:mod:`automap.ir.unremat`); True: the user's remat always stays, for a remat the cost model
    cannot see the reason for, such as memory outside the step).

    Arguments may be flax nnx objects (``train_step(model, optimizer, batch)`` mutating them as
    under ``nnx.jit``): they are planned as their state, which is written back into them after the
    call, sharded per plan (see :mod:`automap.nnx_args`). Any other pytree (``nnx.State``, optax
    states, dicts, equinox Modules, whose non-array leaves are static) is taken as ``jax.jit``
    takes it and never written into (see :mod:`automap.arg_styles`).

    ``mesh`` may have Explicit or mixed axis types (``jax.make_mesh``'s default): the function is
    traced without sharding types and planned and compiled on an ``AxisType.Auto`` view of the same
    devices and axis names; outputs come back on ``mesh`` itself, sharded as the plan says, and
    arguments already laid out as planned (on either view) are not moved. ``shard_map`` inside the
    function keeps its own ``in_specs``/``out_specs``: they are the plan's first decisions.

    >>> import jax, jax.numpy as jnp, automap
    >>> mesh = automap.make_mesh({"data": 1})
    >>> @automap.automap(mesh=mesh)
    ... def step(w, x):
    ...     return jnp.tanh(x @ w).sum()
    >>> round(float(step(jnp.ones((4, 2)), jnp.ones((8, 4)))), 3)
    15.989
    """
    if fn is None:
        return lambda f: Partitioned(f, mesh=mesh, **options)
    return Partitioned(fn, mesh=mesh, **options)


def partition(fn: Callable, *, mesh: Mesh, **options: Any) -> Partitioned:
    """The same as :func:`automap` without decorator syntax: ``partition(train_step, mesh=mesh)``.

    >>> import jax.numpy as jnp, automap
    >>> p = partition(lambda x: x * 2, mesh=automap.make_mesh({"data": 1}))
    >>> p.plan(jnp.ones(4)).program.summary()
    'Program: 1 inputs, 1 outputs, 1 ops (0 regions), 3 values, 1 primitives'
    """
    return Partitioned(fn, mesh=mesh, **options)
