"""A battery of jax.numpy / jax.nn / jax.random / jax.lax calls (and their gradients) whose
jaxprs hold the primitives a user's step emits; tests/automap/test_coverage.py walks them."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

X = jax.ShapeDtypeStruct((4, 8), jnp.float32)
M = jax.ShapeDtypeStruct((4, 4), jnp.float32)
V = jax.ShapeDtypeStruct((4,), jnp.float32)
I = jax.ShapeDtypeStruct((4,), jnp.int32)
U = jax.ShapeDtypeStruct((4, 8), jnp.uint32)
IMG = jax.ShapeDtypeStruct((2, 8, 8, 3), jnp.float32)
QKV = jax.ShapeDtypeStruct((2, 8, 4, 16), jnp.float32)


def _spd(m):
    return m @ m.T + 4 * jnp.eye(4)


def _pool(x):
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _conv(x):
    return lax.conv_general_dilated(x, jnp.ones((3, 3, 3, 4)), (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


# name -> (function, abstract arguments); each also runs under jax.grad (w.r.t. its float arguments)
BATTERY = {
    "numpy_elementwise": (lambda x: jnp.sin(x) + jnp.cos(x) * jnp.tanh(x) - jnp.exp2(x) / (1 + jnp.abs(x))
                          + jnp.log1p(jnp.abs(x)) + jnp.expm1(x) ** 2 + jnp.sqrt(jnp.abs(x)) + jnp.cbrt(x)
                          + jnp.arctan2(x, 1.0) + jnp.sinh(x) + jnp.arcsinh(x) + jnp.floor(x) + jnp.round(x)
                          + jnp.sign(x) + jnp.clip(x, -1, 1) + jnp.maximum(x, 0) + jnp.hypot(x, x)
                          + jnp.logaddexp(x, x) + jnp.where(jnp.isfinite(x), x, 0), (X,)),
    "numpy_integers": (lambda u: (u >> 3) ^ (u << 1) | (u & 7) + jnp.bitwise_count(u) + lax.clz(u)
                       + u // 3 + u % 5, (U,)),
    "numpy_shape": (lambda x: jnp.concatenate([x, x]).T.reshape(2, 32)[:, ::2].sum()
                    + jnp.stack([x, x], -1).mean() + jnp.tile(x, (2, 1)).max() + jnp.roll(x, 1, 0).min()
                    + jnp.pad(x, 1).sum() + jnp.flip(x).sum() + jnp.repeat(x, 2, 0).sum() + jnp.squeeze(x[None]).sum()
                    + sum(jnp.split(x, 2, 1)).sum() + jnp.expand_dims(x, 0).sum() + jnp.unstack(x)[0].sum(), (X,)),
    "numpy_reductions": (lambda x: jnp.cumsum(x, 1).sum() + jnp.cumprod(x, 0).sum() + jnp.sort(x).sum()
                         + jnp.argmax(x) + jnp.argmin(x, 1).sum() + jnp.var(x) + jnp.prod(x) + jnp.any(x > 0)
                         + jnp.all(x > 0) + jax.nn.logsumexp(x) + lax.cummax(x, 1).sum() + jnp.median(x)
                         + jnp.argsort(x).sum() + lax.top_k(x, 2)[0].sum() + jnp.cumulative_sum(x, axis=0).sum(),
                         (X,)),
    "numpy_indexing": (lambda x, i: x[i % 4].sum() + x.at[i % 4].add(1.0).sum() + x.at[i % 4].set(0.0).sum()
                       + x.at[i % 4].multiply(2.0).sum() + x.at[i % 4].max(0.0).sum() + x.at[i % 4].min(0.0).sum()
                       + x.at[i % 4].subtract(1.0).sum() + jnp.take_along_axis(x, (i % 8)[:, None], 1).sum()
                       + lax.dynamic_slice(x, (i[0], 0), (2, 8)).sum()
                       + lax.dynamic_update_slice(x, x[:2], (i[0], 0)).sum(), (X, I)),
    "nn": (lambda x: jax.nn.relu(x).sum() + jax.nn.gelu(x).sum() + jax.nn.softmax(x).sum() + jax.nn.silu(x).sum()
           + jax.nn.sigmoid(x).sum() + jax.nn.log_softmax(x).sum() + jax.nn.one_hot(jnp.argmax(x, 1), 8).sum()
           + jax.nn.standardize(x).sum() + jax.nn.glu(x).sum() + jax.nn.softplus(x).sum() + jax.nn.elu(x).sum()
           + jax.nn.celu(x).sum() + jax.nn.selu(x).sum() + jax.nn.gelu(x, approximate=False).sum(), (X,)),
    "attention": (lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True).sum(), (QKV, QKV, QKV)),
    "conv_pool": (lambda x: _pool(_conv(x)).sum() + lax.reduce_window(x, 0.0, lax.add, (1, 2, 2, 1), (1, 1, 1, 1),
                                                                     "SAME").sum(), (IMG,)),
    "random": (lambda x: (jax.random.normal(jax.random.key(0), x.shape) * x).sum()
               + jax.random.gamma(jax.random.key(1), jnp.abs(x) + 1).sum()
               + jax.random.bernoulli(jax.random.key(2), 0.5, x.shape).sum()
               + jax.random.categorical(jax.random.key(3), x).sum()
               + jax.random.permutation(jax.random.key(4), 8).sum()
               + jax.random.key_data(jax.random.split(jax.random.key(5))).sum()
               + jax.random.fold_in(jax.random.key(6), 3).dtype.itemsize
               + jax.random.beta(jax.random.key(7), 2.0, 3.0, x.shape).sum()
               + jax.random.uniform(jax.random.wrap_key_data(jnp.zeros(2, jnp.uint32)), x.shape).sum()
               + jax.random.truncated_normal(jax.random.key(8), -1, 1, x.shape).sum()
               + lax.rng_bit_generator(jnp.zeros(4, jnp.uint32), (4,))[1].sum(), (X,)),
    "random_keys_batched": (lambda x: jax.vmap(jax.random.gamma)(jax.random.split(jax.random.key(0), 4),
                                                                jnp.abs(x) + 1).sum(), (X,)),
    "linalg": (lambda m, v: jnp.linalg.cholesky(_spd(m)).sum() + jnp.linalg.inv(_spd(m)).sum()
               + jnp.linalg.solve(_spd(m), v).sum() + jnp.linalg.eigh(_spd(m))[0].sum()
               + jnp.linalg.qr(m)[0].sum() + jnp.linalg.svd(m)[1].sum() + jnp.linalg.det(_spd(m))
               + jnp.linalg.slogdet(_spd(m))[1] + lax.linalg.triangular_solve(_spd(m), m, left_side=True).sum()
               + lax.linalg.lu_pivots_to_permutation(jnp.zeros(4, jnp.int32), 4).sum()
               + jnp.linalg.eigvals(m).real.sum()
               + jnp.linalg.pinv(m).sum() + jnp.linalg.lstsq(m, v)[0].sum()
               + lax.linalg.tridiagonal_solve(v, v + 4, v, m).sum(), (M, V)),
    "fft": (lambda x: jnp.abs(jnp.fft.fft(x)).sum() + jnp.fft.rfft(x).real.sum() + jnp.fft.irfft(x).sum(), (X,)),
    "control_flow": (lambda x: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(8), x)[1].sum()
                     + lax.fori_loop(0, 3, lambda i, c: c * 2, x).sum()
                     + lax.cond(x.sum() > 0, jnp.sin, jnp.cos, x).sum()
                     + lax.map(jnp.sum, x).sum() + jax.checkpoint(jnp.sin)(x).sum()
, (X,)),
    "shard_hints": (lambda x: jax.experimental.shard_alike.shard_alike(x, x)[0].sum(), (X,)),
}

# calls without a gradient (no JVP rule, while loops inside, host callbacks): traced as they are
NO_GRAD = {
    "lax_misc": (lambda x: lax.custom_linear_solve(lambda v: _spd(x[:, :4]) @ v, x[0, :4],
                                                   lambda mv, b: jnp.linalg.solve(_spd(x[:, :4]), b)).sum()
                 + lax.reduce_precision(x, 5, 10).sum() + lax.bitcast_convert_type(x, jnp.int32).sum()
                 + lax.optimization_barrier(x).sum() + lax.stop_gradient(x).sum()
                 + lax.ragged_dot(x, jnp.ones((2, 8, 3)), jnp.array([1, 3], jnp.int32)).sum()
                 + lax.approx_max_k(x, 2)[0].sum() + lax.erf_inv(jnp.tanh(x)).sum() + lax.lgamma(x + 5).sum()
                 + lax.digamma(x + 5).sum() + lax.igamma(x + 5, x + 5).sum()
                 + lax.polygamma(1.0, x + 5).sum() + lax.bessel_i0e(x).sum() + lax.bessel_i1e(x).sum()
                 + lax.betainc(2.0, 3.0, jax.nn.sigmoid(x)).sum() + lax.random_gamma_grad(x + 5, x + 5).sum()
                 + lax.complex(x, x).real.sum() + lax.conj(lax.complex(x, x)).imag.sum()
                 + lax.population_count(x.astype(jnp.int32)).sum() + lax.iota(jnp.float32, 4).sum()
                 + lax.broadcasted_iota(jnp.int32, (4, 8), 1).sum() + lax.sort_key_val(x, x)[1].sum()
                 + lax.select_n(jnp.int32(1), x, x).sum() + lax.empty((2,), jnp.float32).sum() * 0
                 + lax.rem(x, 3.0).sum() + lax.pow(jnp.abs(x), 0.5).sum() + lax.square(x).sum()
                 + lax.rsqrt(x * x + 1).sum() + lax.tan(x).sum() + lax.acos(jnp.tanh(x)).sum(), (X,)),
    "callbacks": (lambda x: jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x).sum()
                  + (jax.debug.print("{}", x.sum()), x.sum())[1]
                  + (jax.debug.callback(lambda a: None, x), x.sum())[1], (X,)),
    "no_jvp": (lambda x, m: jnp.nextafter(x, 0).sum() + lax.zeta(x + 5, 2.0).sum()
               + lax.linalg.cholesky_update(jnp.linalg.cholesky(_spd(m)), m[0]).sum()
               + lax.linalg.symmetric_product(m, m).sum()
               + lax.linalg.ormqr(m, m[0], m).sum()
               + lax.while_loop(lambda c: c.sum() < 100, lambda c: c * 2 + 1, x).sum(), (X, M)),
}
