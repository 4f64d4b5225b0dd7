"""XLA as the arbiter: never compile worse than ``jax.jit`` given the same input shardings.

At the first call per signature, :class:`~automap.api.Partitioned` compiles the plan's pinned
program (its in/out shardings plus ``with_sharding_constraint`` on the pinned intermediates)
and, when that is affordable, also the *inputs-only* program (the same in/out shardings, no
intermediate constraints: what ``jax.jit(step, in_shardings=..., out_shardings=...)`` makes of
them). Both are measured (:func:`automap.measure`) and the better one is kept (:func:`prefer`):

- fewer bytes sent per device wins, unless its memory per device grows by more than
  :data:`MEMORY_SLACK` (5%);
- on equal bytes sent (within :data:`BYTES_TIE`, 1%), less memory wins;
- otherwise the pinned program (the plan's own) is kept, unless it sends more bytes or takes more
  memory than the inputs-only program (``jax.jit``'s) by more than :data:`PARITY` (5%) in either
  figure (:func:`within_parity`): a pinned program that trades 10% fewer bytes for 20% more memory
  is not kept (flax ``nn.RNN(OptimizedLSTMCell)`` classifier, FSDP specs, mesh 2x4: 0.90x / 1.20x
  ``jax.jit``'s; now ``jax.jit``'s program).

A program worse in both is dominated and never kept. Under the user's ``memory_budget`` a program
XLA measures within it beats one over it before any of this (the plan was made to fit). ``arbiter`` (an option of
:func:`automap.automap`): ``"auto"`` (the default) arbitrates programs of at most
:data:`AUTO_MAX_OPS` ops (two compiles of a small program are cheap; above that the second compile
would cost as much as the first), and for those the search's final candidates are compiled and
measured too (:func:`final_choice`: the answer, the expert ceiling plan, the next best, the
expert compositions of the (bytes, memory) front and FSDP over the whole mesh jointly; XLA's
measure moves the fastest of them only to one no heavier in either figure); ``None`` keeps the pinned program unmeasured (one compile) and the search's answer
by estimate; ``"always"``: both at any size; ``"search"``: the same as ``"auto"`` (kept for plans
written with it). Under the default pins
(:func:`automap.emit.pinned_values`, ``"plan"``) a plan without a ``scan`` that decided only its
inputs (the user's specs, the tactic plans) pins nothing: its one program *is* the inputs-only program, so nothing is
compiled twice; only a plan that decided layouts of intermediates pays the second compile (zoo
2-layer GPT, default plan, 2x4, 8 CPU devices: first call 7.8 s; pinning its 47 contractions and
arbitrating took 14.2 s). The plan's report says which program was kept and the measured figures.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Optional

from automap.measure import Measurement, measure
from automap.report import human_bytes

__all__ = ["Arbiter", "Arbitration", "prefer", "within_parity", "affordable", "arbitrate", "final_choice", "estimated_figures", "AUTO_MAX_OPS",
           "MEMORY_SLACK", "BYTES_TIE", "PARITY"]

Arbiter = Optional[Literal["auto", "always", "search"]]
AUTO_MAX_OPS = 4000  # ops in the lowered program (scan bodies counted once): above, "auto" compiles once
MEMORY_SLACK = 0.05
BYTES_TIE = 0.01
PARITY = 0.05  # the kept program's bytes sent and memory at most this much above jax.jit's (inputs-only)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One compiled program and XLA's measure of it."""

    name: str  # "pinned" or "inputs-only"
    jitted: Any  # the jax.jit function
    compiled: Any  # its jax.stages.Compiled
    measurement: Measurement

    @property
    def bytes_sent(self) -> float:
        return self.measurement.wire_bytes

    @property
    def memory(self) -> int:
        return self.measurement.memory_per_device or 0

    def describe(self) -> str:
        return f"{self.name} {human_bytes(self.bytes_sent)} sent, {human_bytes(self.memory)} memory per device"


@dataclasses.dataclass(frozen=True)
class Arbitration:
    """Which compiled program was kept, and the measured candidates (the kept one first)."""

    kept: Candidate
    others: tuple[Candidate, ...]

    def note(self) -> str:
        """One line for the plan's report (the figures are XLA's measure, not estimates)."""
        if not self.others:
            return f"compiled: {self.kept.name} program (measured: {self.kept.describe()})"
        rest = "; ".join(c.describe() for c in self.others)
        return (f"compiled: kept the {self.kept.name} program by XLA's measure ({self.kept.describe()}) over "
                f"{rest}")


def prefer(a: Measurement, b: Measurement) -> bool:
    """Whether ``b`` is better than ``a`` (see the module docstring for the order).

    >>> from automap.measure import Measurement, MemoryStat
    >>> def m(sent_all_reduce_bytes, memory):
    ...     from automap.measure import CollectiveOp
    ...     op = CollectiveOp("all-reduce", sent_all_reduce_bytes, 1, [[0, 1]], "ar", "main", group_size=2)
    ...     return Measurement({}, MemoryStat(memory, 0, 0, 0), 0, [op])
    >>> prefer(m(1000, 100), m(500, 104)), prefer(m(1000, 100), m(500, 110)), prefer(m(1000, 100), m(1005, 90))
    (True, False, True)
    """
    wa, wb = a.wire_bytes, b.wire_bytes
    ma, mb = a.memory_per_device or 0, b.memory_per_device or 0
    if abs(wb - wa) <= BYTES_TIE * max(wa, wb):
        return mb < ma
    return wb < wa and mb <= ma * (1 + MEMORY_SLACK)


def within_parity(a: Measurement, reference: Measurement) -> bool:
    """Whether ``a`` sends at most ``1 + PARITY`` times the bytes of ``reference`` and holds at most
    ``1 + PARITY`` times its memory per device (both figures: a trade of one for the other is not
    within parity).

    >>> from automap.measure import Measurement, MemoryStat, CollectiveOp
    >>> def m(sent_all_reduce_bytes, memory):
    ...     op = CollectiveOp("all-reduce", sent_all_reduce_bytes, 1, [[0, 1]], "ar", "main", group_size=2)
    ...     return Measurement({}, MemoryStat(memory, 0, 0, 0), 0, [op])
    >>> within_parity(m(900, 120), m(1000, 100)), within_parity(m(1040, 104), m(1000, 100))
    (False, True)
    """
    def at_most(x: float, y: float) -> bool:
        return x <= y * (1 + PARITY)
    return (at_most(a.wire_bytes, reference.wire_bytes)
            and at_most(a.memory_per_device or 0, reference.memory_per_device or 0))


def affordable(arbiter: Arbiter, program: Any) -> bool:
    """Whether to compile a second program for ``program`` (a lowered :class:`Program`)."""
    if arbiter is None:
        return False
    if arbiter == "always":
        return True
    if arbiter in ("auto", "search"):
        return len(program.ops) + sum(len(r.ops) for op in program.ops for r in op.regions) <= AUTO_MAX_OPS
    raise ValueError(f"arbiter must be 'auto', 'always', 'search' or None, got {arbiter!r}")


def arbitrate(candidates: dict[str, Callable[[], Any]], abstract_args: list[Any],
              reference: str | None = None, budget: int | None = None) -> Arbitration:
    """Compile each candidate (name -> a function returning its ``jax.jit``), measure it, and keep
    the best by :func:`prefer`; ties keep the earlier one (list the plan's own program first). With
    a ``reference`` (``jax.jit``'s own program), the best is kept only :func:`within_parity` of it;
    otherwise the reference is. Under a memory ``budget`` (bytes per device) a program XLA
    measures within it beats one over it, whatever the other figures: the plan was made to fit."""
    built = []
    for name, make in candidates.items():
        jitted = make()
        compiled = jitted.lower(*abstract_args).compile()
        built.append(Candidate(name, jitted, compiled, measure(compiled)))

    def fits(c: Candidate) -> bool:
        return budget is None or c.memory <= budget

    best = built[0]
    for c in built[1:]:
        if fits(c) > fits(best) or (fits(c) == fits(best) and prefer(best.measurement, c.measurement)):
            best = c
    ref = next((c for c in built if c.name == reference), None)
    if ref is not None and not within_parity(best.measurement, ref.measurement) and fits(ref) >= fits(best):
        best = ref
    return Arbitration(best, tuple(c for c in built if c is not best))


# --- the search's last step (arbiter "auto", "always", "search") -------------------------------------------------------


def final_choice(answer: tuple[str, Any, Any], alternatives: tuple[tuple[str, Any, Any], ...],
                 measure_state: Callable[[Any], Measurement], budget: int | None = None,
                 judge: str = "measured by XLA") -> tuple[Any, str]:
    """XLA arbitrates the search's final candidates: the answer, the expert ceiling plan, the next
    best, the expert compositions of the (bytes, memory) front and FSDP over the whole mesh
    (:func:`search.mcts._alternatives`), each ``(label, state, score)``.
    Each is compiled and measured (``measure_state``). A candidate is admitted when its measured
    bytes sent are at most the ceiling plan's (within :data:`BYTES_TIE`) and its memory at most
    the ceiling's (within :data:`MEMORY_SLACK`), so the ceiling promise holds by XLA's measure
    (without a ceiling plan among them, the answer's measure is the ceiling). The fastest admitted
    candidate by the cost model's time (each priced in the layout it compiles to:
    :func:`search.mcts.as_emitted`) is the start; while an admitted candidate *beats* the one
    kept by XLA's measure (no worse in bytes sent and memory within :data:`MEMORY_SLACK`, as
    :func:`prefer` trades them, and better in one by more than :data:`BYTES_TIE`; the kept one
    not so against it), the fastest such not kept before replaces it: XLA's measure moves the
    choice only to a plan no heavier in either figure (within the slack), and it ends where no
    admitted candidate beats the answer. (The fastest plan that no candidate dominates, kept before, may be slower
    than a plan dropped and send more bytes: on a GShard MoE, batch 8, mesh 2x4, 64.6 KiB sent,
    130.2 KiB, 0.942 ms was kept, ``dp + expert_parallel``'s 48.1 KiB, 206.3 KiB, 0.476 ms
    dropped for a slower plan of 48.3 KiB, 138.2 KiB, 0.990 ms, which the climb keeps.) A climb
    that moved to a slower plan for its memory also moves on to an expert plan (a tactic
    composition: labelled ``expert``) of the measured front (one no admitted candidate beats) that
    the cost model prices faster than the one kept and XLA measures sending fewer bytes (by more
    than :data:`BYTES_TIE`): memory alone does not keep a plan that is slower by estimate and
    heavier on the wire than an undominated plan an expert writes. (Held-out keras-hub Qwen-MoE, mesh
    2x4: the climb went from the answer, 290.3 KiB sent, 1.0 MiB, 1.220 ms, to
    ``data_parallel('data') + megatron('model')``, 301.2 KiB, 706.1 KiB, 1.873 ms, and kept it over
    expert parallelism on data, ``data_parallel('data') + expert_parallel('model', tokens=False)``,
    192.0 KiB, 1.2 MiB, 1.506 ms, the hand-written plan, which it keeps now. A searched plan so
    placed moves nothing: on the GShard MoE with 8 experts, batch 8, the next best, 42.4 KiB,
    320.0 KiB, 0.708 ms, leaves ``megatron('data') + expert_parallel('model')`` kept, 60.5 KiB,
    172.3 KiB, 0.931 ms, lighter in both than the hand-written plan, 69.6 KiB, 311.6 KiB.)
    Under a memory ``budget`` (bytes per device) only the
    candidates XLA measures within it compete, where any is (the estimate may put a plan under the
    budget that XLA's program exceeds); where none of those passes the ceiling, the fastest of
    them is kept; where none is within it, the one XLA measures smallest (the nearest to what the
    user asked; the note names its measured and estimated memory; the planner then searches again
    under a tighter budget, :func:`automap.planner._search_within_measure`). Before, the fastest
    admitted one: held-out ``nnx_lora`` under 95.7 KiB kept the answer, 114.2 KiB, over ZeRO-3 on
    the whole mesh, 107.0 KiB. Returns (its state, a note for the plan's report). ``judge`` names
    where the figures come from in the note (:func:`estimated_figures` gives the cost model's, for
    a program too large to compile them all).

    >>> import types
    >>> from automap.measure import CollectiveOp, MemoryStat
    >>> def m(sent, memory):
    ...     op = CollectiveOp("all-gather", 2 * sent, 1, [[0, 1]], "ag", "main", group_size=2)
    ...     return Measurement({}, MemoryStat(memory, 0, 0, 0), 0, [op])
    >>> measured = {"a": m(900, 100), "e": m(600, 100), "n": m(500, 90), "f": m(400, 80)}
    >>> fast = lambda t: types.SimpleNamespace(time_s=t)
    >>> state, note = final_choice(("answer", "a", fast(1.0)), (("expert ceiling", "e", fast(1.2)),
    ...                            ("next best", "n", fast(1.1))), measured.__getitem__)
    >>> state  # the answer sends more than the expert plan by XLA's measure: the next best is kept
    'n'
    >>> final_choice(("answer", "a", fast(1.0)), (("expert ceiling", "e", fast(1.2)), ("next best", "n", fast(1.1)),
    ...              ("expert (f)", "f", fast(3.0))), measured.__getitem__)[0]  # f is leaner in both than n
    'f'
    >>> measured = {"a": m(120, 516), "p": m(48, 206), "x": m(64, 130), "y": m(49, 138)}  # the MoE's figures
    >>> final_choice(("answer", "a", fast(0.30)), (("expert (p)", "p", fast(0.48)), ("expert (x)", "x", fast(0.94)),
    ...              ("expert (y)", "y", fast(0.99))), measured.__getitem__)[0]  # a -> p -> y; x sends more than p
    'y'
    >>> measured["q"] = m(30, 300)  # on the front, faster than y and sending fewer bytes: y's memory trade undone
    >>> final_choice(("answer", "a", fast(0.30)), (("expert (p)", "p", fast(0.48)), ("expert (x)", "x", fast(0.94)),
    ...              ("expert (y)", "y", fast(0.99)), ("expert (q)", "q", fast(0.60))), measured.__getitem__)[0]
    'q'
    >>> measured = {"a": m(500, 101), "n": m(520, 99)}  # the answer measured over a budget of 100, n within
    >>> final_choice(("answer", "a", fast(1.0)), (("next best", "n", fast(1.1)),), measured.__getitem__, budget=100)[0]
    'n'
    >>> final_choice(("answer", "a", fast(1.0)), (("next best", "n", fast(1.1)),), measured.__getitem__,
    ...              budget=90)[1].split("; ")[-1]  # none within 90: the smallest by XLA's measure is kept
    "none within the budget of 90 B: kept the smallest by XLA's measure, 99 B"
    """
    measured = [(label, state, score, measure_state(state)) for label, state, score in (answer,) + tuple(alternatives)]
    ceiling = next((c for c in measured if c[0].startswith("expert ceiling")), measured[0])[3]
    fit = [c for c in measured if budget is None or (c[3].memory_per_device or 0) <= budget]
    got = fit or measured  # where nothing fits by XLA's measure, the budget cannot choose

    def admitted(m: Measurement) -> bool:
        return (m.wire_bytes <= ceiling.wire_bytes * (1 + BYTES_TIE)
                and (m.memory_per_device or 0) <= (ceiling.memory_per_device or 0) * (1 + MEMORY_SLACK))

    def dominates(q: Measurement, m: Measurement, slack: float) -> bool:
        qb, qm, mb, mm = q.wire_bytes, q.memory_per_device or 0, m.wire_bytes, m.memory_per_device or 0
        return (qb <= mb * (1 + slack) and qm <= mm * (1 + slack)
                and (qb < mb * (1 - BYTES_TIE) or qm < mm * (1 - BYTES_TIE)))

    def beats(q: Measurement, m: Measurement) -> bool:
        return dominates(q, m, MEMORY_SLACK) and not dominates(m, q, MEMORY_SLACK)

    if budget is not None and not fit:  # none fits: the budget is what the user asked, the smallest comes nearest
        kept = min(measured, key=lambda c: (c[3].memory_per_device or 0, c[2].time_s))
    else:
        pool = [c for c in got if admitted(c[3])] or (got if len(got) < len(measured) else [])
        kept = min(pool, key=lambda c: c[2].time_s)
        seen = [kept]
        front = [c for c in pool if not any(beats(q[3], c[3]) for q in pool if q is not c)]

        def quicker_on_the_wire(q: tuple, k: tuple) -> bool:  # an expert plan of the front, faster, sending fewer bytes
            return (q[0].startswith("expert") and any(q is f for f in front) and q[2].time_s < k[2].time_s
                    and q[3].wire_bytes < k[3].wire_bytes * (1 - BYTES_TIE))

        while better := [c for c in pool if not any(c is s for s in seen)
                         and (beats(c[3], kept[3]) or quicker_on_the_wire(c, kept))]:
            kept = min(better, key=lambda c: c[2].time_s)
            seen.append(kept)
    figures = "; ".join(f"{label} {human_bytes(m.wire_bytes)} sent, {human_bytes(m.memory_per_device or 0)} "
                        f"memory, estimated {score.time_s * 1e3:.3f} ms" for label, _, score, m in measured)
    within = "" if budget is None else (f"; {len(fit)} of {len(measured)} within the budget of {human_bytes(budget)}"
                                        if fit else f"; none within the budget of {human_bytes(budget)}: kept the "
                                        f"smallest by XLA's measure, {human_bytes(kept[3].memory_per_device or 0)}"
                                        f"{_estimated(kept[2])}")
    return kept[1], f"search arbiter: kept the {kept[0]}; {judge}: {figures}{within}"


@dataclasses.dataclass(frozen=True)
class EstimatedFigures:
    """The cost model's bytes sent and peak memory per device of one final candidate, in the two
    fields :func:`final_choice` reads of a :class:`~automap.measure.Measurement`."""

    wire_bytes: float
    memory_per_device: int


def estimated_figures(candidates: tuple[tuple[str, Any, Any], ...]) -> Callable[[Any], EstimatedFigures]:
    """``measure_state`` for :func:`final_choice` by estimate: each candidate ``(label, state,
    score)``'s estimated bytes sent and peak memory, looked up by its state. Under ``arbiter="auto"``
    a program above :data:`AUTO_MAX_OPS` is not compiled more than once, so the search's last step
    weighs its final candidates by the same rule on the cost model's figures (held-out Hugging Face
    BART, 4,030 ops, mesh 2x4: the fastest answer, data parallel over the whole mesh, was kept, and
    hand-written FSDP sent and held less by XLA's measure, 332.0 KiB and 552.2 KiB against 343.0 KiB
    and 1.1 MiB; now the climb keeps a plan of 282.9 KiB and 641.0 KiB by estimate, 298.9 KiB and
    647.7 KiB by XLA's, the plan ``arbiter="always"`` keeps after compiling each candidate).

    >>> import types
    >>> score = lambda t, sent, peak: types.SimpleNamespace(time_s=t, peak_bytes=peak,
    ...                                                     estimate=types.SimpleNamespace(wire_bytes=sent))
    >>> answer = ("answer", "dp", score(1.0, 343, 1200))
    >>> others = (("expert (fsdp)", "fsdp", score(16.0, 330, 521)),)
    >>> final_choice(answer, others, estimated_figures((answer,) + others), judge="estimated")
    ('fsdp', 'search arbiter: kept the expert (fsdp); estimated: answer 343 B sent, 1.2 KiB memory, estimated 1000.000 ms; expert (fsdp) 330 B sent, 521 B memory, estimated 16000.000 ms')
    """
    figures = [(state, EstimatedFigures(score.estimate.wire_bytes, score.peak_bytes)) for _, state, score in candidates]
    return lambda state: next(f for s, f in figures if s is state)


def _estimated(score: Any) -> str:
    """`` (estimated N)``: a final candidate's estimated peak memory per device, where its score has one."""
    peak = getattr(score, "peak_bytes", None)
    return "" if peak is None else f" (estimated {human_bytes(peak)})"
