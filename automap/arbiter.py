"""XLA as the arbiter: never compile worse than ``jax.jit`` given the same input shardings.

At the first call per signature, :class:`~automap.api.Partitioned` compiles the plan's pinned
program (its in/out shardings plus ``with_sharding_constraint`` on the pinned intermediates)
and, when that is affordable, also the *inputs-only* program (the same in/out shardings, no
intermediate constraints: what ``jax.jit(step, in_shardings=..., out_shardings=...)`` makes of
them). Both are measured (:func:`automap.measure`) and the better one is kept (:func:`prefer`):

- fewer bytes sent per device wins, unless its memory per device grows by more than
  :data:`MEMORY_SLACK` (5%);
- on equal bytes sent (within :data:`BYTES_TIE`, 1%), less memory wins;
- otherwise the pinned program (the plan's own) is kept.

A program worse in both is dominated and never kept. ``arbiter`` (an option of
:func:`automap.automap`): ``"auto"`` (the default) arbitrates programs of at most
:data:`AUTO_MAX_OPS` ops (two compiles of a small program are cheap; above that the second compile
would cost as much as the first), and for those the search's final candidates are compiled and
measured too (:func:`final_choice`: the answer, the expert ceiling plan, the next best and the
expert compositions of the (bytes, memory) front, ordered by the search's objective with XLA's
measure in place of the estimate: the faster step, then fewer bytes sent, then less memory);
``None`` keeps the pinned program unmeasured (one compile) and the search's answer by estimate;
``"always"``: both at any size; ``"search"``: the same as ``"auto"`` (kept for plans written with
it). Under the default pins
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

__all__ = ["Arbiter", "Arbitration", "prefer", "affordable", "arbitrate", "final_choice", "measured_time", "AUTO_MAX_OPS",
           "MEMORY_SLACK", "BYTES_TIE"]

Arbiter = Optional[Literal["auto", "always", "search"]]
AUTO_MAX_OPS = 4000  # ops in the lowered program (scan bodies counted once): above, "auto" compiles once
MEMORY_SLACK = 0.05
BYTES_TIE = 0.01


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


def affordable(arbiter: Arbiter, program: Any) -> bool:
    """Whether to compile a second program for ``program`` (a lowered :class:`Program`)."""
    if arbiter is None:
        return False
    if arbiter == "always":
        return True
    if arbiter in ("auto", "search"):
        return len(program.ops) + sum(len(r.ops) for op in program.ops for r in op.regions) <= AUTO_MAX_OPS
    raise ValueError(f"arbiter must be 'auto', 'always', 'search' or None, got {arbiter!r}")


def arbitrate(candidates: dict[str, Callable[[], Any]], abstract_args: list[Any]) -> Arbitration:
    """Compile each candidate (name -> a function returning its ``jax.jit``), measure it, and keep
    the best by :func:`prefer`; ties keep the earlier one (list the plan's own program first)."""
    built = []
    for name, make in candidates.items():
        jitted = make()
        compiled = jitted.lower(*abstract_args).compile()
        built.append(Candidate(name, jitted, compiled, measure(compiled)))
    best = built[0]
    for c in built[1:]:
        if prefer(best.measurement, c.measurement):
            best = c
    return Arbitration(best, tuple(c for c in built if c is not best))


# --- the search's last step (arbiter "auto", "always", "search") -------------------------------------------------------


def final_choice(answer: tuple[str, Any, Any], alternatives: tuple[tuple[str, Any, Any], ...],
                 measure_state: Callable[[Any], Measurement]) -> tuple[Any, str]:
    """XLA arbitrates the search's final candidates: the answer, the expert ceiling plan, the next
    best and the expert compositions of the (bytes, memory) front, each ``(label, state, score)``.
    Each is compiled and measured (``measure_state``), and the search's one objective
    (:class:`search.objective.Objective`: the faster step; steps within its tie tolerance go to
    fewer bytes sent, then less memory) chooses among them with XLA's measure in place of the
    estimate wherever XLA measures it:

    1. *Admitted*: measured bytes sent at most the ceiling plan's (within :data:`BYTES_TIE`) and
       memory at most the ceiling's (within :data:`MEMORY_SLACK`), so the ceiling promise holds
       by XLA's measure (without a ceiling plan among them, the answer's measure is the ceiling).
    2. *Time first*: the cost model's step time re-priced with XLA's dot FLOPs and bytes sent
       (:func:`measured_time`); the candidates within the objective's tie tolerance of the
       fastest tie.
    3. *Ties by measure*: of those, the fewest bytes sent (within :data:`BYTES_TIE`), then the
       least memory, then the faster: the kept plan is dominated in (bytes sent, memory) by no
       candidate as fast as it.

    Dominance does not trade time: the rule before dropped an admitted candidate that another one
    dominated by XLA's measure whatever their times, and kept a step 5.7x slower by estimate
    (corpus llama_gqa, mesh 2x4: the search's data_parallel('data'), 0.199 ms, 52.4 KiB sent and
    323.0 KiB memory by XLA, estimated exactly, replaced by dp + megatron + fsdp, 1.140 ms, 40.0
    KiB, 82.1 KiB) and the unsharded step on nnx/eqx_transformer (228-238 us against data
    parallel's 186 us). A plan an expert plan dominates in bytes and memory is now kept when the
    cost model, given what XLA compiles, finds it faster (on these small models: Megatron's
    per-collective latency); the report's note gives every candidate's figures. Letting dominance
    trade time within a bound from the model's measured error instead would change none of the
    corpus defaults: the defaults' estimates are exact in bytes sent and within 6% in memory, and
    the least time a dominating manual plan asks is 1.19x (python benchmarks/fidelity.py: 7 of 30
    (default, manual) pairs dominated in bytes and memory, default 1.19-18.1x faster by estimate
    in each; 0 dominated and not faster).
    Returns (the kept state, a note for the plan's report).

    >>> import types
    >>> from automap.measure import CollectiveOp, MemoryStat
    >>> def m(sent, memory):
    ...     op = CollectiveOp("all-gather", 2 * sent, 1, [[0, 1]], "ag", "main", group_size=2)
    ...     return Measurement({}, MemoryStat(memory, 0, 0, 0), 0, [op])
    >>> def est(t, sent):  # a step all communication, sending ``sent`` bytes by estimate
    ...     return types.SimpleNamespace(time_s=t, estimate=types.SimpleNamespace(
    ...         wire_bytes=sent, dot_flops=0, compute_time_s=0.0, comm_time_s=t))
    >>> measured = {"a": m(900, 100), "e": m(600, 100), "n": m(500, 90), "slow": m(400, 80), "tie": m(450, 95)}
    >>> state, note = final_choice(("answer", "a", est(1.0, 900)), (("expert ceiling", "e", est(1.2, 600)),
    ...                            ("next best", "n", est(1.1, 500))), measured.__getitem__)
    >>> state  # the answer sends more than the expert ceiling by XLA's measure: not admitted
    'n'
    >>> final_choice(("answer", "e", est(1.0, 600)), (("expert (slow)", "slow", est(5.0, 400)),),
    ...              measured.__getitem__)[0]  # leaner in both by XLA's measure, but 5x slower
    'e'
    >>> final_choice(("answer", "e", est(1.0, 600)), (("expert (tie)", "tie", est(1.005, 450)),),
    ...              measured.__getitem__)[0]  # as fast within the tie tolerance: fewer bytes by XLA's measure
    'tie'
    >>> final_choice(("answer", "e", est(1.0, 600)), (("expert (slow)", "slow", est(2.0, 200)),),
    ...              measured.__getitem__)[0]  # XLA sends twice its estimate: 2.0 -> 4.0 ms
    'e'
    """
    from search.objective import Objective

    tolerance = Objective().tolerance
    got = [(label, state, score, measure_state(state)) for label, state, score in (answer,) + tuple(alternatives)]
    ceiling = next((c for c in got if c[0].startswith("expert ceiling")), got[0])[3]

    def admitted(m: Measurement) -> bool:
        return (m.wire_bytes <= ceiling.wire_bytes * (1 + BYTES_TIE)
                and (m.memory_per_device or 0) <= (ceiling.memory_per_device or 0) * (1 + MEMORY_SLACK))

    pool = [(c, measured_time(c[2].estimate, c[3])) for c in got if admitted(c[3])]
    fastest = min(t for _, t in pool)
    band = [(c, t) for c, t in pool if t <= fastest * (1 + tolerance)]
    fewest = min(c[3].wire_bytes for c, _ in band)
    band = [(c, t) for c, t in band if c[3].wire_bytes <= fewest * (1 + BYTES_TIE)]
    kept = min(band, key=lambda ct: (ct[0][3].memory_per_device or 0, ct[1]))[0]
    figures = "; ".join(f"{label} {human_bytes(m.wire_bytes)} sent, {human_bytes(m.memory_per_device or 0)} "
                        f"memory, estimated {score.time_s * 1e3:.3f} ms"
                        + (f" ({measured_time(score.estimate, m) * 1e3:.3f} ms at XLA's bytes and FLOPs)"
                           if abs(measured_time(score.estimate, m) - score.time_s) > tolerance * score.time_s else "")
                        for label, _, score, m in got)
    return kept[1], f"search arbiter: kept the {kept[0]}; measured by XLA: {figures}"


def measured_time(estimate: Any, m: Measurement) -> float:
    """The cost model's step time (:class:`automap.cost.Estimate`: a compute term plus a
    communication term) with XLA's measure in place of the estimate: the compute term scaled by
    XLA / estimated dot FLOPs, the communication term by XLA / estimated bytes sent (a figure the
    estimate puts at 0 is left as estimated: there is nothing to scale).

    >>> import types
    >>> from automap.measure import CollectiveOp, MemoryStat
    >>> op = CollectiveOp("all-reduce", 1000, 1, [[0, 1]], "ar", "main", group_size=2)  # 1,000 B sent
    >>> m = Measurement({}, MemoryStat(0, 0, 0, 0), 300, [op])
    >>> est = lambda wire, flops: types.SimpleNamespace(wire_bytes=wire, dot_flops=flops, compute_time_s=1.0,
    ...                                                 comm_time_s=2.0)
    >>> measured_time(est(1000, 300), m), measured_time(est(2000, 300), m), measured_time(est(500, 600), m)
    (3.0, 2.0, 4.5)
    """
    def scale(measured: float, estimated: float) -> float:
        return measured / estimated if estimated > 0 else 1.0

    return (estimate.compute_time_s * scale(m.dot_flops, estimate.dot_flops)
            + estimate.comm_time_s * scale(m.wire_bytes, estimate.wire_bytes))
