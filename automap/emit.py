"""Emission: a plan becomes a ``jax.jit`` of the program replayed with sharding constraints.

The lowered :class:`~automap.ir.program.Program` is replayed op by op (:func:`automap._compat.replay_eqn`:
``bind``, or a one-equation jaxpr for higher-order primitives such as ``shard_map``),
with ``jax.lax.with_sharding_constraint`` after the values the plan pins. ``scan`` bodies are
replayed inside a new ``jax.lax.scan`` (so their values get constraints too), inlined remat calls
are wrapped in ``jax.checkpoint`` again, ``cond``/``while`` are re-bound as they were.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Literal, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from automap import _compat
from automap.analysis import reshards
from automap.ir.program import Op, Program
from automap.propagate import propagate
from automap.rules import traits_of
from automap.shardings import ShardingState, to_partition_spec

PinPolicy = Literal["plan", "anchors", "all", "none"]


def pinned_values(state: ShardingState, policy: PinPolicy = "plan") -> frozenset[int]:
    """The values that get a sharding constraint.

    ``plan`` (the default): what the plan decided (:func:`decided_values`: every intermediate
    whose planned layout differs from what propagation from the inputs alone gives) and, when it
    decided any, both sides of every resharding the cost model priced (:func:`resharded_values`)
    and the anchors below: XLA's propagation from a few pinned values can part from automap's
    (the ragged MoE under ``expert_parallel``: its 14 decided values alone compiled 110,700 B
    sent against 36,864 B estimated; with the anchors 36,912 B); a plan with a ``scan`` is pinned so
    whatever it decided (:func:`_has_scan`). A plan without one that decided only its inputs pins nothing: it compiles to what
    ``jax.jit`` makes of the same in/out shardings, and is estimated in the layout XLA gives it
    (:mod:`automap.xla_layout`) (pinning the priced reshardings of such a plan
    as well compiled to 1.35-1.48x jax.jit's bytes sent under FSDP specs:
    ``python benchmarks/fidelity.py --pins anchors --plans manual_fsdp``).
    ``anchors``: results of the ops whose traits say ``emit="pin"`` (contractions and embedding
    lookups/updates), whatever the plan decided; ``all``: every intermediate; ``none``: only the
    inputs and outputs are fixed. Values inside ``cond``/``while`` (re-bound as they were),
    inputs, scalars and keys are never pinned.
    """
    if policy == "none":
        return frozenset()
    pinnable = _pinnable(state.program)
    if policy == "all":
        return frozenset(pinnable)
    anchors = frozenset(v for v, op in pinnable.items() if traits_of(op.primitive).pinned)
    if policy == "anchors":
        return anchors
    if policy == "plan":
        decided = decided_values(state)
        if decided or _has_scan(state.program):  # XLA's propagation can part from automap's: anchor it
            decided = decided | resharded_values(state) | anchors
        return frozenset(v for v in decided if v in pinnable)
    raise ValueError(f"unknown pin policy {policy!r}")


def _has_scan(program: Program) -> bool:
    """Whether the program runs a ``scan``: XLA gives a loop's carry one layout for its init and
    its body together, where automap's propagation from the inputs alone can give another (the
    scanned zoo GPT-2's default plan, the embedding's d on ``model`` and nothing else decided:
    XLA carried the residual stream d-sharded and every layer's dots contracted over ``model``,
    73.7 MiB sent and 138.9 MiB memory against 14.7 and 64.4 MiB estimated; anchored 12.7 and
    58.1 MiB). A plan with a scan is pinned as one that decided something. It stays so now that
    the estimate models the inputs-only program of a loop too (:mod:`automap.xla_loops`): the
    arbiter compiles both, and the pinned one is what it keeps for corpus gpt_linen_scan under
    ``fsdp_tp`` (nothing decided; 429,306 B sent and 1.05 MB memory against the inputs-only
    program's 553,146 B and 1.25 MB, mesh 2x4); the held-out flax LSTM's and gpt_linen_scan's
    ``manual_fsdp`` keep the inputs-only one."""
    return any(op.primitive == "scan" for op, _ in program.walk())


def _pinnable(program: Program) -> dict[int, Op]:
    """Value id -> the op making it, for every value a constraint can reach (top level and
    ``scan`` bodies, which are replayed with a rewritten body)."""
    out: dict[int, Op] = {}

    def visit(ops: Sequence[Op]) -> None:
        for op in ops:
            if op.primitive == "scan":
                for region in op.regions:
                    visit(region.ops)
            if op.primitive == "scan" or not op.regions:  # cond/while are re-bound as they were: nothing
                out.update((v, op) for v in op.outputs if _constrainable(program, v))  # inside them is pinned

    visit(program.ops)
    return out


def unplanned(state: ShardingState) -> ShardingState:
    """The layout propagation gives from the plan's input specs alone (each input dim at the
    priority of the decision that set it): the plan itself when it decided nothing but the inputs."""
    program = state.program
    levels: dict[int, list[tuple[int, int]]] = {}  # priority -> the input dims it set
    for v in program.inputs:
        for d, axes in enumerate(state.spec(v)):
            if axes:
                levels.setdefault(state.priority.get((v, d), 0), []).append((v, d))
    free = ShardingState(program, state.axes, frozen=frozenset(program.inputs), next_priority=state.next_priority)
    for p in sorted(levels):  # in the order they were decided: the earlier wins where they meet
        specs, prio = dict(free.specs), dict(free.priority)
        for v, d in levels[p]:
            spec = list(specs.get(v) or tuple(() for _ in program.values[v].shape))
            spec[d] = state.spec(v)[d]
            specs[v], prio[(v, d)] = tuple(spec), p
        free = propagate(free.replace(specs=specs, priority=prio), [v for v, _ in levels[p]])
    return free


def decided_values(state: ShardingState) -> frozenset[int]:
    """The intermediates whose planned spec differs from :func:`unplanned`'s: the plan's decisions
    past its inputs (a resharded activation, sequence parallelism, a user's ``shard_map``
    boundary). Program outputs are fixed by ``out_shardings`` and not counted."""
    free = unplanned(state)
    outputs = set(state.program.outputs)
    return frozenset(v for v in _pinnable(state.program) if v not in outputs and state.spec(v) != free.spec(v))


def resharded_values(state: ShardingState) -> frozenset[int]:
    """Both sides of every collective the cost model priced: a resharded operand as it is and the
    results of the op that needs it otherwise; a resharded result and the op's other results."""
    ops = {op.id: op for op in state.program.all_ops}
    out: set[int] = set()
    for r in reshards(state):
        out.add(r.value)
        out.update(ops[r.op].outputs)
    return frozenset(out)


def _constrainable(program: Program, vid: int) -> bool:
    v = program.values[vid]
    try:
        return v.ndim > 0 and np.dtype(v.dtype).kind in "biufc"
    except TypeError:  # PRNG keys and other extended dtypes
        return False


class _Replay:
    def __init__(self, state: ShardingState, mesh: Mesh, pins: frozenset[int], guard: Mapping[int, Any] | None = None):
        self.program = state.program
        self.state = state
        self.mesh = mesh
        self.pins = pins
        self.shared = _shared_values(self.program)
        self.guard = guard or {}  # op id -> (operand specs, result spec, priced specs): automap.grouped_conv_guard

    def sharding(self, vid: int) -> NamedSharding:
        return NamedSharding(self.mesh, self.state.partition_spec(vid))

    def get(self, env: dict, vid: int) -> Any:
        if vid in env:
            return env[vid]
        value = self.program.values[vid]
        if value.kind in ("literal", "const"):
            return value.literal
        raise KeyError(f"value {value!r} used before it is defined")

    def put(self, env: dict, vid: int, x: Any) -> None:
        if vid in self.pins:
            x = jax.lax.with_sharding_constraint(x, self.sharding(vid))
        env[vid] = x

    def run(self, ops: Sequence[Op], env: dict, depth: int = 0) -> None:
        i = 0
        while i < len(ops):
            op = ops[i]
            if len(op.remat) > depth:
                rid = op.remat[depth]
                j = i
                while j < len(ops) and len(ops[j].remat) > depth and ops[j].remat[depth] == rid:
                    j += 1
                self.run_remat(ops[i:j], rid, env, depth)
                i = j
                continue
            self.run_op(op, env)
            i += 1

    def run_remat(self, ops: Sequence[Op], rid: int, env: dict, depth: int) -> None:
        call = self.program.remat_calls[rid]

        def body(*args: Any) -> list[Any]:
            inner = dict(zip(call.inputs, args, strict=True))
            self.run(ops, inner, depth + 1)
            return [self.get(inner, v) for v in call.outputs]

        params = call.params
        fn = jax.checkpoint(body, prevent_cse=params.get("prevent_cse", True), policy=params.get("policy"))
        outs = fn(*[self.get(env, v) for v in call.inputs])
        for vid, x in zip(call.outputs, outs, strict=True):
            if vid not in env:
                self.put(env, vid, x)

    def run_op(self, op: Op, env: dict) -> None:
        args = [self.get(env, v) for v in op.inputs]
        if traits_of(op.primitive).emit == "whole_cut_operand" and op.inputs and op.inputs[0] in self.shared:
            args[0] = self.whole_cut_dims(op, args[0])
        guard = self.guard.get(op.id)
        if guard is not None:  # a batch-grouped conv in the layout priced (automap.grouped_conv_guard)
            args = [self.constrain(self.constrain(x, was) if _splits_more(spec, was) else x, spec)
                    for x, spec, was in zip(args, guard[0], guard[2][:-1], strict=True)]
        with jax.named_scope(op_scope(op)):  # the HLO's op_name metadata names automap's op
            if op.primitive == "scan":
                outs = self.run_scan(op, args)
            else:
                outs = _compat.replay_eqn(op.eqn, args)
        if guard is not None:
            outs = [self.constrain(outs[0], guard[1])]
            if _splits_more(guard[1], guard[2][-1]):
                outs = [self.constrain(outs[0], guard[2][-1])]
        for vid, x in zip(op.outputs, outs, strict=True):
            self.put(env, vid, x)

    def constrain(self, x: Any, spec: Any) -> Any:
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, to_partition_spec(spec)))

    def whole_cut_dims(self, op: Op, x: Any) -> Any:
        """Constrain a slice's operand to its planned spec with the cut dims whole (the rule
        blocks them: the plan all-gathers there), when the operand has other uses. Left to
        itself, XLA's SPMD partitioner (jax 0.10.2, Shardy and GSPMD) partially gathers a prefix
        slice of a sharded dim and then reuses that buffer for the operand's other replicated
        uses: wrong numbers or an HLO verifier error (``jit(lambda x: (wsc(x[:4], P()), x))``
        with ``x`` on ``P("a")`` returns ``x[:4]`` twice)."""
        vid = op.inputs[0]
        value = self.program.values[vid]
        if not op.has_rule or value.kind in ("literal", "const") or not value.ndim:
            return x
        spec = self.state.spec(vid)
        cut = {d for d, fs in enumerate(op.rule.operands[0]) if not fs and spec[d]}
        if not cut:
            return x
        whole = tuple(() if d in cut else axes for d, axes in enumerate(spec))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, to_partition_spec(whole)))

    def run_scan(self, op: Op, args: list[Any]) -> list[Any]:
        (region,) = op.regions
        p = op.params
        nc, nk = p["num_consts"], p["num_carry"]
        consts, init, xs = args[:nc], args[nc : nc + nk], args[nc + nk :]

        def body(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            env: dict[int, Any] = {}
            for vid, val in zip(region.inputs, list(consts) + list(carry) + list(x), strict=True):
                self.put(env, vid, val)
            self.run(region.ops, env)
            outs = [self.get(env, v) for v in region.outputs]
            return outs[:nk], outs[nk:]

        carry, ys = jax.lax.scan(
            body, list(init), list(xs), length=p["length"], reverse=p["reverse"], unroll=p.get("unroll", 1)
        )
        return list(carry) + list(ys)


def op_scope(op: Op) -> str:
    """The name scope an op is replayed in: its module path and ``#`` its id, so the compiled
    HLO's ``op_name`` metadata reads e.g. ``jit(fn)/GPT/blocks_0/attn #12/dot_general``
    (:func:`ops_of_metadata` reads the id back)."""
    return f"{op.name} #{op.id}" if op.name else f"#{op.id}"


_OP_ID = re.compile(r" ?#(\d+)/")


def ops_of_metadata(op_name: str) -> list[int]:
    """The ids of the automap ops an HLO ``op_name`` names: the innermost of each name XLA joined
    with ``:`` when it combined instructions (``jit(fn)/(a #1/x:b #2/y)``); empty if none.

    >>> ops_of_metadata("jit(fn)/GPT #3/attn #12/dot_general"), ops_of_metadata("jit(fn)/(a #1/x:b #2/y)")
    ([12], [1, 2])
    >>> ops_of_metadata("jit(fn)/add")
    []
    """
    out = []
    for part in op_name.split(":"):
        got = _OP_ID.findall(part)
        if got and int(got[-1]) not in out:
            out.append(int(got[-1]))
    return out


def _shared_values(program: Program) -> frozenset[int]:
    """Values read more than once (by ops, in regions too, or as program outputs)."""
    uses: dict[int, int] = {}

    def visit(ops: Sequence[Op]) -> None:
        for op in ops:
            for v in op.inputs:
                uses[v] = uses.get(v, 0) + 1
            for region in op.regions:
                visit(region.ops)
                for v in region.outputs:
                    uses[v] = uses.get(v, 0) + 1

    visit(program.ops)
    for v in program.outputs:
        uses[v] = uses.get(v, 0) + 1
    return frozenset(v for v, n in uses.items() if n > 1)


def _splits_more(spec: Any, than: Any) -> bool:
    """Whether ``spec`` splits on a mesh axis ``than`` does not: a guarded conv's operand split
    further for it is pinned in its priced layout first, else XLA's propagation spreads the split
    to its producers (:mod:`automap.grouped_conv_guard`; a constraint to a coarser layout leaves
    them be, and a pin there kept XLA from sharing the conv's gather with the forward conv's).

    >>> _splits_more(((("data", "model")), ()), (("data",), ())), _splits_more(((), ()), (("data",), ()))
    (True, False)
    """
    return bool({a for axes in spec for a in axes} - {a for axes in than for a in axes})


def replay_fn(state: ShardingState, mesh: Mesh, pins: Iterable[int]) -> Callable[..., list[Any]]:
    """A function of the program's flat inputs returning its flat outputs, with constraints: on
    the pinned values, and on the operands and result of every batch-grouped convolution XLA
    could split past its groups or sum wrong, in the layout the program is priced in
    (:mod:`automap.grouped_conv_guard`: the plan's where it pins anything, else the layout XLA's
    propagation gives it, :func:`automap.xla_layout.xla_layout`)."""
    pins = frozenset(pins)
    replay = _Replay(state, mesh, pins, _guard(state, pins))
    program = state.program

    def fn(*flat: Any) -> list[Any]:
        env: dict[int, Any] = dict(zip(program.inputs, flat, strict=True))
        replay.run(program.ops, env)
        return [replay.get(env, v) for v in program.outputs]

    return fn


def _guard(state: ShardingState, pins: frozenset[int]) -> dict[int, Any]:
    """:func:`automap.grouped_conv_guard.guarded_layouts` of the layout the program is priced in."""
    from automap.grouped_conv_guard import at_risk, guarded_layouts
    from automap.xla_layout import xla_layout

    if not any(at_risk(op, state.axes) for op, _ in state.program.walked):
        return {}
    return guarded_layouts(state if pins else xla_layout(state))


def shardings(state: ShardingState, mesh: Mesh, vids: Sequence[int]) -> list[NamedSharding]:
    return [NamedSharding(mesh, state.partition_spec(v)) for v in vids]


def compile_plan(
    state: ShardingState,
    mesh: Mesh,
    *,
    pins: Iterable[int],
    out_specs: Sequence[Any] | None = None,
    donate_argnums: Sequence[int] = (),
) -> Any:
    """``jax.jit`` of the replayed program with the plan's in/out shardings (flat arguments)."""
    program = state.program
    ins = shardings(state, mesh, program.inputs)
    outs = shardings(state, mesh, program.outputs) if out_specs is None else list(out_specs)
    return jax.jit(replay_fn(state, mesh, pins), in_shardings=ins, out_shardings=outs, donate_argnums=tuple(donate_argnums))
