"""Control flow: scan / cond / while keep their bodies as regions tied to the op's operands and
results (the stacked dim of scanned values is never sharded); jit, checkpoint, custom_jvp and
custom_vjp calls are inlined."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from harness import check, ints, row

S = (16, 32)
DM = P("data", "model")
L = 4  # layers / scan length


def scan_elementwise(c, xs):
    def body(c, x):
        c = jnp.tanh(c * x + c)
        return c, c * 2
    return lax.scan(body, c, xs)


def scan_reduce(c, xs):
    def body(c, x):
        c = jnp.sin(c + x)
        return c, c.sum(1)
    return lax.scan(body, c, xs)


def mlp(x, w1, w2):  # a residual block, scaled so that 4 layers stay well conditioned
    return x + jnp.tanh(x @ w1 * 0.2) @ w2 * 0.1


def scan_layers(x, w1, w2):
    return lax.scan(lambda x, w: (mlp(x, *w), None), x, (w1, w2))[0]


def scan_layers_remat(x, w1, w2):
    return lax.scan(lambda x, w: (jax.checkpoint(mlp)(x, *w), None), x, (w1, w2))[0]


def cond_fn(p, x):
    return lax.cond(p > 0, lambda x: x * 2, jnp.sin, x)


def cond_reduce(p, x):
    return lax.cond(p > 0, lambda x: x * x.sum(1, keepdims=True), jnp.cos, x)


def while_count(x):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1]) + 1), (0, x))


def while_until(x):
    return lax.while_loop(lambda x: jnp.max(jnp.abs(x)) < 10.0, lambda x: x * 1.5 + 0.1, x)


@jax.custom_jvp
def softclip(x):
    return jnp.tanh(x) * 2


softclip.defjvp(lambda primals, tangents: (softclip(primals[0]), tangents[0] * 2 / jnp.cosh(primals[0]) ** 2))


@jax.custom_vjp
def scaled_sin(x):
    return jnp.sin(x) * 3


scaled_sin.defvjp(lambda x: (scaled_sin(x), jnp.cos(x)), lambda c, g: (3 * g * c,))


def grad_remat_mlp(w1, w2, x):
    return jax.grad(lambda w1, w2: jax.checkpoint(mlp)(x, w1, w2).sum(), argnums=(0, 1))(w1, w2)


ROWS = [
    # name, fn, args, input specs, output spec(s), collective kinds
    row("scan_carry_xs", scan_elementwise, [S, (L, *S)], {"c": DM, "xs": P(None, "data", "model")},
        (DM, P(None, "data", "model")), set(), inner={"tanh": DM, "mul#1": DM}),
    row("scan_carry_only", scan_elementwise, [S, (L, *S)], {"c": DM}, (DM, P(None, "data", "model")), set(),
        inner={"add": DM}),
    row("scan_xs_only", scan_elementwise, [S, (L, *S)], {"xs": P(None, None, "model")},
        (P(None, "model"), P(None, None, "model")), set(), inner={"tanh": P(None, "model")}),
    row("scan_body_reduce", scan_reduce, [S, (L, *S)], {"c": DM, "xs": P(None, "data", "model")},
        (DM, P(None, "data")), {"all-reduce"}, inner={"reduce_sum": P("data")}),
    # the stacked (layers) dim is never sharded: xs is gathered, the body sees whole values
    row("scan_stacked_dim", scan_elementwise, [S, (L, *S)], {"xs": P("data")}, (P(), P()), {"all-gather"},
        inner={"tanh": P()}),
    row("scan_layers_megatron", scan_layers, [S, (L, 32, 64), (L, 64, 32)],
        {"x": P("data"), "w1": P(None, None, "model"), "w2": P(None, "model")}, P("data"), {"all-reduce"},
        inner={"tanh": DM}),
    row("scan_layers_remat", scan_layers_remat, [S, (L, 32, 64), (L, 64, 32)],
        {"x": P("data"), "w1": P(None, None, "model"), "w2": P(None, "model")}, P("data"), {"all-reduce"},
        inner={"tanh": DM}),
    row("cond", cond_fn, [ints((), 2), S], {"x": DM}, DM, set(), inner={"sin": DM, "mul": DM}),
    row("cond_branch_reduce", cond_reduce, [ints((), 2), S], {"x": DM}, DM, {"all-reduce"},
        inner={"reduce_sum": P("data"), "cos": DM}),
    row("while_counter", while_count, [S], {"x": DM}, (P(), DM), set(), inner={"tanh": DM}),
    row("while_cond_reduce", while_until, [S], {"x": DM}, DM, {"all-reduce"}, inner={"reduce_max": P()}),
    row("nested_jit", lambda x, w: jax.jit(lambda x: jnp.tanh(x @ w))(x), [S, (32, 64)], {"x": P("data")},
        P("data"), set(), inner={"tanh": P("data")}),
    row("checkpoint", lambda x, w1, w2: jax.checkpoint(mlp)(x, w1, w2), [S, (32, 64), (64, 32)],
        {"x": P("data"), "w1": P(None, "model"), "w2": P("model")}, P("data"), {"all-reduce"},
        inner={"tanh": DM}),
    # the data-parallel gradient of a rematerialised MLP: weight gradients are all-reduced
    row("grad_checkpoint", grad_remat_mlp, [(32, 64), (64, 32), S], {"x": P("data")}, (P(), P()),
        {"all-reduce"}),
    row("custom_jvp_relu", jax.nn.relu, [S], {"x": DM}, DM, set(), inner={"max": DM}),
    row("custom_jvp_user", lambda x: softclip(x) + 1, [S], {"x": DM}, DM, set(), inner={"tanh": DM}),
    row("custom_jvp_grad", jax.grad(lambda x: jax.nn.relu(softclip(x)).sum()), [S], {"x": DM}, DM, set()),
    row("custom_vjp", scaled_sin, [S], {"x": DM}, DM, set(), inner={"sin": DM}),
    row("custom_vjp_grad", jax.grad(lambda x: scaled_sin(x).sum()), [S], {"x": P(None, "model")},
        P(None, "model"), set(), inner={"cos": P(None, "model")}),
]


@pytest.mark.parametrize("r", ROWS)
def test_control_flow(r):
    check(r)
