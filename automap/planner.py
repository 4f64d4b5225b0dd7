"""From a function and example arguments to a :class:`~automap.plan.Plan`: trace, lower, run the
tactic schedule (and, later, the search), tie fed-back outputs to their inputs, choose pins."""
from __future__ import annotations

from typing import Any, Callable, Sequence

from jax.sharding import Mesh

from automap import _compat, emit
from automap.arbiter import affordable, estimated_figures, final_choice
from automap.cost import default_topology
from automap.ir.lower import lower
from automap.rules.user_annotations import fix_user_shardings
from automap.shardings import ShardingState
from automap.ir.program import Program
from automap.report import human_bytes
from automap.trace import Traced, feedback_pairs, trace


def trace_and_lower(
    fn: Callable, args: Sequence[Any], *, static_argnums: Sequence[int] = (), strict: bool = False
) -> tuple[Traced, Program]:
    """Trace ``fn(*args)`` abstractly and lower it to a :class:`~automap.ir.program.Program`.

    >>> import jax.numpy as jnp
    >>> traced, program = trace_and_lower(lambda x: x * 2, (jnp.ones(4),))
    >>> traced.in_paths, program.summary()
    (('x',), 'Program: 1 inputs, 1 outputs, 1 ops (0 regions), 3 values, 1 primitives')
    """
    traced = trace(fn, args, static_argnums=static_argnums)
    return traced, lower(traced.closed_jaxpr, traced.in_paths, traced.out_paths, strict=strict)


def donated_inputs(
    program: Program, traced: Traced, n_args: int, static_argnums: Sequence[int], donate_argnums: Sequence[int]
) -> frozenset[int]:
    """The input value ids of the arguments in ``donate_argnums`` (positions count static ones)."""
    dynamic = [i for i in range(n_args) if i not in set(static_argnums)]
    donated_args = {dynamic.index(i) for i in donate_argnums if i in dynamic}
    return frozenset(v for v, a in zip(program.inputs, traced.leaf_arg, strict=True) if a in donated_args)


def resolve_topology(topology: Any) -> Any:
    """A preset name becomes its :class:`~automap.cost.Topology`; None and Topology pass."""
    if isinstance(topology, str):
        from automap.cost import Topology

        return Topology.preset(topology)
    return topology


def default_search(tactics: Sequence[Any] | None, axes: dict[str, int]) -> Any:
    """``search="auto"``: with no tactics, MCTS over every mesh axis; with tactics, a search
    only if they leave a mesh axis unused (decided after they ran: ``"auto-fill"``)."""
    import search

    if not any(n > 1 for n in axes.values()):
        return None  # nothing to decide on a single device
    return search.MCTS() if tactics is None else "auto-fill"


def _fill_search(state: ShardingState) -> Any:
    import search

    used = {a for spec in state.specs.values() for dim in spec for a in dim}
    free = [a for a, n in state.axes.items() if n > 1 and a not in used]
    return search.MCTS() if free else None


def make_plan(
    fn: Callable,
    args: Sequence[Any],
    mesh: Mesh,
    *,
    tactics: Sequence[Any] | None = None,
    static_argnums: Sequence[int] = (),
    strict: bool = False,
    pins: emit.PinPolicy = "plan",
    topology: Any = None,
    donate_argnums: Sequence[int] = (),
    search: Any = "auto",
    memory_budget: Any = None,
    arbiter: Any = None,
    keep_user_remat: bool = False,
) -> Any:
    from automap.plan import Plan
    from tactics import PlanContext, batch_over_all_axes, run_schedule

    traced, program = trace_and_lower(fn, args, static_argnums=static_argnums, strict=strict)
    axes = {str(k): int(v) for k, v in mesh.shape.items()}
    pairs = feedback_pairs(traced)
    state_inputs = tuple(sorted({program.inputs[i] for i in pairs.values()}))
    data_inputs = tuple(v for v in program.inputs if v not in set(state_inputs))
    ctx = PlanContext(program, axes, data_inputs, state_inputs)
    topology = resolve_topology(topology)
    if search == "auto":
        search = default_search(tactics, axes)
    if tactics is not None:
        schedule = list(tactics)
    else:  # no tactics: the search decides everything; without a search, the batch tactic
        schedule = [] if search is not None else [batch_over_all_axes()]
    # the user's own shardings (shard_map boundaries) are the first decisions; the rest fills around
    result = run_schedule(schedule, ctx, fix_user_shardings(ShardingState.initial(program, axes)))
    state = result.state
    notes = result.notes
    donated = donated_inputs(program, traced, len(args), static_argnums, donate_argnums)
    if search == "auto-fill":
        search = _fill_search(state)
    if search is not None:  # fill what the tactics left open
        from search.planning import MemoryBudgetError, run_search

        before = state

        emitted_layout = _emitted_layout(program, pairs, pins)

        def research(budget: Any) -> tuple[ShardingState, Any]:  # the search again, under another budget
            return run_search(search, before, topology=topology, memory_budget=budget, donated=donated,
                              data_inputs=data_inputs, context=ctx, keep_user_remat=keep_user_remat,
                              emitted_layout=emitted_layout)[:2]

        unfit = None  # no plan fits by estimate: XLA's measure of the final candidates must find one
        try:
            state, found, search_notes = run_search(
                search, state, topology=topology, memory_budget=memory_budget, donated=donated,
                data_inputs=data_inputs, context=ctx, keep_user_remat=keep_user_remat, emitted_layout=emitted_layout,
            )
        except MemoryBudgetError as error:  # the estimate errs both ways: XLA measures its candidates
            if error.result is None or not error.result.alternatives or not affordable(arbiter, program):
                raise
            unfit, found = error, error.result
            state, search_notes = found.state, ("search: no plan within the budget by estimate; XLA measured its "
                                                "final candidates",)
        notes = notes + search_notes
        if state.program.recomputed and unfit is None and affordable(arbiter, program):  # XLA has the last word
            measure_state = _state_measurer(traced, program, mesh, pairs, pins)
            state, more = _fit_by_measure(state, found, measure_state, research, memory_budget, topology, donated,
                                          emitted_layout)
            notes = notes + more
            if memory_budget is not None:
                _warn_if_over(state, measure_state, memory_budget, topology, donated, emitted_layout)
        elif (found.alternatives or memory_budget is not None) and affordable(arbiter, program):  # XLA decides last
            measure_state = _state_measurer(traced, program, mesh, pairs, pins)
            budget = None
            if memory_budget is not None:
                from search.planning import budget_bytes

                budget = budget_bytes(memory_budget, topology or default_topology())
            if found.alternatives:
                state, note = final_choice(("answer", state, found.score), found.alternatives, measure_state, budget)
                notes = notes + (note,)
            if budget is not None and (measure_state(state).memory_per_device or 0) > budget:
                state, more = _search_within_measure(state, measure_state, research, budget, topology, donated,
                                                     emitted_layout)
                notes = notes + more
            if budget is not None and (measure_state(state).memory_per_device or 0) > budget:
                state, more = _recompute_final_candidates(state, found, measure_state, budget, topology, donated,
                                                          emitted_layout)
                notes = notes + more
            if budget is not None and (measure_state(state).memory_per_device or 0) > budget:
                if unfit is None:  # (where no plan fits by estimate either, the search's error is raised below)
                    _warn_if_over(state, measure_state, memory_budget, topology, donated, emitted_layout)
            if unfit is not None:
                got = measure_state(state).memory_per_device or 0
                if got > budget:  # the error names what XLA measured too: the estimate is not the last word
                    est = _estimated_peak(state, emitted_layout, topology, donated)
                    unfit.args = (f"{unfit.args[0]}. XLA measured the search's final candidates (and those of "
                                  f"searches under the budget scaled by its measure, and them recomputing blocks): "
                                  f"the smallest is "
                                  f"{human_bytes(got)} per device{_measured_terms(measure_state(state))} "
                                  f"({human_bytes(est)} by estimate)",)
                    raise unfit
                notes = notes + (f"search: XLA measures the plan within the budget: {human_bytes(got)}",)
        elif found.alternatives and arbiter in ("auto", "search") and unfit is None:  # too large to compile each
            answer = ("answer", state, found.score)  # the same last step on the cost model's figures
            state, note = final_choice(answer, found.alternatives, estimated_figures((answer,) + found.alternatives),
                                       judge="estimated (the program is too large to compile each)")
            notes = notes + (note,)

    state, out_specs = _tie_outputs(state, program, pairs)
    plan = Plan(
        mesh, traced, program, state, emit.pinned_values(state, pins), tuple(out_specs), notes,
        result.reasons, topology, donated,
    )
    if memory_budget is not None and search is None:  # a search checks its own plans against the budget
        from search.planning import check_budget

        check_budget(state, plan.estimate.peak_memory_bytes, memory_budget)
    return plan


def _estimated_peak(state: ShardingState, laid_out: Callable[[ShardingState], ShardingState] | None, topology: Any,
                    donated: Any) -> int:
    """The cost model's peak memory per device of ``state`` as it compiles (``laid_out``: the
    emitted layout, :func:`_emitted_layout`; a plan that pins nothing compiles to XLA's own), the
    figure held against XLA's measure of it."""
    from automap.cost import estimate

    laid = state if laid_out is None else laid_out(state)
    return estimate(laid, topology, donated=tuple(donated)).peak_memory_bytes


def _fit_by_measure(state: ShardingState, found: Any, measure_state: Callable, research: Callable,
                    memory_budget: Any, topology: Any, donated: Any,
                    laid_out: Callable | None = None) -> tuple[ShardingState, tuple[str, ...]]:
    """A recomputing plan XLA measures over the budget gets more blocks recomputed, then the other
    recomputing plans (:func:`search.recompute.fit_by_measure`); if all stay over, the search runs
    once more under the budget scaled by what XLA measured against the estimate (the estimate's
    own error, calibrated on this program), and XLA measures its answer the same way; where that
    search fits nothing by estimate, its final candidates (leaner by estimate) are measured so.
    The estimate is that of the layout each plan compiles to (``laid_out``)."""
    from search.planning import MemoryBudgetError, budget_bytes
    from search.recompute import fit_by_measure

    budget = budget_bytes(memory_budget, topology or default_topology())
    fallbacks = [alt for _, alt, _ in found.alternatives]  # the other recomputing plans, best first
    state, note, got = fit_by_measure(state, budget, measure_state, topology, tuple(donated), fallbacks, laid_out)
    notes = (note,)
    if got is not None and got > budget:
        scaled = int(budget * _estimated_peak(state, laid_out, topology, donated) / got)
        unfit = ""
        try:
            again, refound = research(scaled)
        except MemoryBudgetError as error:  # its final candidates, leaner by estimate, may fit by XLA's measure
            if error.result is None or not error.result.alternatives:
                return state, notes + (f"recompute: no plan within {human_bytes(scaled)} by estimate, the budget "
                                       "scaled by XLA's measure; kept the plan XLA measured smallest",)
            again, refound, unfit = error.result.state, error.result, ", no plan within it: its final candidates"
        fallbacks = [alt for _, alt, _ in refound.alternatives]
        again, note, got_again = fit_by_measure(again, budget, measure_state, topology, tuple(donated), fallbacks,
                                                laid_out)
        notes += (f"recompute: searched again under {human_bytes(scaled)} by estimate (the budget scaled by "
                  f"XLA's measure over the estimate{unfit}); {note}",)
        if got_again is not None and got_again < got:
            state = again
    return state, notes


def _recompute_final_candidates(state: ShardingState, found: Any, measure_state: Callable, budget: int,
                                topology: Any, donated: Any,
                                laid_out: Callable | None = None) -> tuple[ShardingState, tuple[str, ...]]:
    """Every final candidate XLA measured over the budget, and no plan fits it by estimate with
    recomputation either (or the search's recomputing plans were not measured): the candidates
    (the answer and its alternatives, without recomputation) are made to fit by XLA's measure
    (:func:`search.recompute.fit_candidates_by_measure`); the plan kept is the one XLA measures
    smaller. Before, no recomputing version of them was measured: held-out ``attention_sdpa``
    stayed at 291.8 KiB over a budget of 234.0 KiB."""
    from search.recompute import fit_candidates_by_measure

    candidates = [found.state] + [alt for _, alt, _ in found.alternatives]
    got = fit_candidates_by_measure(candidates, budget, measure_state, topology, tuple(donated), laid_out)
    if got is None:
        return state, ()
    again, note, measured = got
    if measured is not None and measured < (measure_state(state).memory_per_device or 0):
        return again, (note,)
    return state, (note + "; kept the plan measured before",)


def _warn_if_over(state: ShardingState, measure_state: Callable, memory_budget: Any, topology: Any,
                  donated: Any, laid_out: Callable | None = None) -> None:
    """Warn where the kept plan is still over the user's ``memory_budget`` by XLA's measure (its
    notes say what was tried), naming the measured and the estimated memory per device (of the
    layout it compiles to, ``laid_out``)."""
    import warnings

    from search.planning import budget_bytes

    budget = budget_bytes(memory_budget, topology or default_topology())
    measured = measure_state(state)
    got = measured.memory_per_device or 0
    if got > budget:
        est = _estimated_peak(state, laid_out, topology, donated)
        warnings.warn(f"automap: no plan found within memory_budget={memory_budget!r} ({human_bytes(budget)} per "
                      f"device) by XLA's measure; kept the smallest XLA measured: {human_bytes(got)}"
                      f"{_measured_terms(measured)} ({human_bytes(est)} by the search's estimate). plan.notes say "
                      "what was tried", stacklevel=5)


def _measured_terms(measured: Any) -> str:
    """XLA's memory per device in its terms, where it has them: the arguments and outputs (the
    state in and out, no recomputation shrinks them; a plan only by sharding more or donating)
    and the temporaries (what recomputation and re-gathering act on)."""
    m = getattr(measured, "memory", None)
    if m is None:
        return ""
    alias = f" - alias {human_bytes(m.alias)}" if m.alias else ""
    return (f" = arguments {human_bytes(m.argument)} + outputs {human_bytes(m.output)}{alias} (the state in and "
            f"out) + temporaries {human_bytes(m.temp)}")


SCALED_SEARCHES = 3  # at most this many searches again under a budget scaled by XLA's measure


def _search_within_measure(state: ShardingState, measure_state: Callable, research: Callable, budget: int,
                           topology: Any, donated: Any,
                           laid_out: Callable | None = None) -> tuple[ShardingState, tuple[str, ...]]:
    """The search's final candidates all measured over the budget by XLA: the search runs again
    under the budget scaled by what XLA measured against the estimate of the last plan (the
    estimate's own error, calibrated on this program), XLA arbitrating its final candidates as
    before, until a plan fits by XLA's measure (at most :data:`SCALED_SEARCHES` times: the error
    differs from plan to plan); where nothing fits the scaled budget by estimate, XLA measures that
    search's final candidates (its answer, the expert ceiling, the leanest compositions) and it stops.
    The plan XLA measures smallest is kept. Each round is a search and a few compiles: bounded by
    :data:`SCALED_SEARCHES`, and run only where a budget was given and XLA measured it missed.
    The estimate is that of the layout the plan compiles to (``laid_out``)."""
    from search.planning import MemoryBudgetError

    kept, kept_got = state, measure_state(state).memory_per_device or 0
    last, got, lines = state, kept_got, []
    for _ in range(SCALED_SEARCHES):
        scaled = int(budget * _estimated_peak(last, laid_out, topology, donated) / got)
        unfit = False
        try:
            last, refound = research(scaled)
        except MemoryBudgetError as error:  # its final candidates, leaner by estimate, may fit by XLA's measure
            if error.result is None or not error.result.alternatives:
                lines.append(f"no plan within {human_bytes(scaled)} by estimate")
                break
            unfit, last, refound = True, error.result.state, error.result
        if refound.alternatives:
            last = final_choice(("answer", last, refound.score), refound.alternatives, measure_state, budget)[0]
        got = measure_state(last).memory_per_device or 0
        lines.append(f"under {human_bytes(scaled)} by estimate: {'no plan within it; its final candidates ' if unfit else ''}"
                     f"{human_bytes(got)} by XLA's measure")
        if got < kept_got:
            kept, kept_got = last, got
        if got <= budget or unfit:
            break
    verdict = "within" if kept_got <= budget else "still over"
    return kept, (f"search: every final candidate over the budget of {human_bytes(budget)} by XLA's measure; "
                  f"searched again under the budget scaled by XLA's measure over the estimate: {'; '.join(lines)}; "
                  f"kept {human_bytes(kept_got)} ({verdict})",)


def _tie_outputs(state: ShardingState, program: Program, pairs: dict[int, int]) -> tuple[ShardingState, list]:
    """Outputs that feed back as inputs keep the input's sharding (no resharding between steps)."""
    out_specs = [state.spec(v) for v in program.outputs]
    specs = dict(state.specs)
    inputs = set(program.inputs)
    for o, i in pairs.items():
        want = state.spec(program.inputs[i])
        out_specs[o] = want
        vid = program.outputs[o]
        if vid not in inputs and state.spec(vid) != want:
            specs[vid] = want
    return state.replace(specs=specs), out_specs


def _emitted_layout(program: Program, pairs: dict[int, int],
                    pins: emit.PinPolicy) -> Callable[[ShardingState], ShardingState]:
    """A function giving a search state's layout as its plan compiles (what
    :attr:`automap.plan.Plan.layout` prices): for a plan that pins nothing, the layout XLA's
    propagation gives its specs (fed-back outputs tied); otherwise the state itself."""
    from automap.xla_layout import xla_layout

    def laid_out(state: ShardingState) -> ShardingState:
        tied, _ = _tie_outputs(state, program, pairs)
        return state if emit.pinned_values(tied, pins) else xla_layout(tied)

    return laid_out


def _state_measurer(traced: Traced, program: Program, mesh: Mesh, pairs: dict[int, int],
                    pins: emit.PinPolicy) -> Callable[[ShardingState], Any]:
    """A function compiling a search state as the plan would (pinned, fed-back outputs tied;
    no donation) and returning XLA's measure of it (each state compiled once)."""
    import jax
    from jax.sharding import NamedSharding

    from automap.measure import measure
    from automap.shardings import to_partition_spec

    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in traced.in_avals]
    mesh = _compat.auto_view(mesh)  # emitted on the Auto view, as the call does

    seen: dict[int, tuple[ShardingState, Any]] = {}  # id -> (the state, kept alive; its measure)

    def measure_state(state: ShardingState) -> Any:
        if id(state) not in seen:
            tied, out_specs = _tie_outputs(state, program, pairs)
            outs = [NamedSharding(mesh, to_partition_spec(s)) for s in out_specs]
            jitted = emit.compile_plan(tied, mesh, pins=emit.pinned_values(tied, pins), out_specs=outs)
            seen[id(state)] = (state, measure(jitted.lower(*args).compile()))
        return seen[id(state)][1]

    return measure_state
