"""The liveness model behind the memory estimate, on programs small enough to count by hand
(every value below is a 64x64 float32 matrix, 16 KiB, unless it is a scalar)."""
import jax
import jax.numpy as jnp

from automap.cost.memory import estimate_memory, materialized
from automap.ir.lower import lower
from automap.shardings import ShardingState

KIB16 = 64 * 64 * 4
M = jnp.ones((64, 64))


def _memory(fn, *, donated=()):
    prog = lower(jax.make_jaxpr(fn)(M, M), ["x", "w"], ["out"])
    state = ShardingState.initial(prog, {"data": 2})
    return prog, estimate_memory(state, donated=[prog.inputs[i] for i in donated])


def test_a_fused_value_keeps_its_sources_alive_until_its_last_reader():
    def fn(x, w):
        y = x @ w  # materialized
        z = y * 2.0  # fused: recomputed where it is read, at the end, so y lives until then
        a = jnp.tanh(x) @ w  # while this runs: y, tanh(x) and a
        return (a + z).sum()

    _, mem = _memory(fn)
    assert mem.temp == 3 * KIB16  # ending y at its direct reader (the multiply) would give 2


def test_an_expensive_result_read_twice_is_stored_a_cheap_one_is_recomputed():
    def fn(activation):
        def f(x, w):
            y = x @ w
            e = activation(y)
            return e.sum() + (e * y).sum()  # two readers of e
        return f

    prog, expensive = _memory(fn(jnp.exp))
    exp_out = next(op.outputs[0] for op in prog.ops if op.primitive == "exp")
    assert exp_out in materialized(prog.ops, prog.outputs)
    _, cheap = _memory(fn(lambda y: y * 2.0))
    # y and exp(y) stored, against y only (and a 4-byte partial sum, in both)
    assert (expensive.temp, cheap.temp) == (2 * KIB16 + 4, KIB16 + 4)


def test_output_buffers_hold_temporaries_until_the_output_is_written():
    def fn(x, w):
        return w - (x @ w).sum()  # x @ w lives before the new w is written: it fits in its buffer

    _, mem = _memory(fn)
    # the 4-byte sum is read while the new w is written: a temporary of its own
    assert (mem.outputs, mem.temp, mem.peak) == (KIB16, 4, 3 * KIB16 + 4)
    _, donated = _memory(fn, donated=(1,))  # the new w takes the old one's buffer: no room left
    assert (donated.aliased, donated.temp, donated.peak) == (KIB16, KIB16 + 4, 3 * KIB16 + 4)
