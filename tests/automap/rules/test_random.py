"""PRNG: random bits are generated where they live (partitionable threefry): their dims are
parallel factors, a key array's dims map to the leading dims of the bits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from harness import check, row

S = (16, 32)
DM = P("data", "model")
KEY_DATA = np.array([0, 42], np.uint32)
KEYS_DATA = np.stack([np.arange(16, dtype=np.uint32), np.arange(16, 32, dtype=np.uint32)], axis=1)  # (16, 2)


def dropout(x):
    keep = jax.random.bernoulli(jax.random.key(0), 0.75, x.shape)
    return jnp.where(keep, x / 0.75, 0.0)


def noise_from_key_data(key_data, x):
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), 3)
    return x + 0.1 * jax.random.normal(key, x.shape)


def per_row_keys(x):
    keys = jax.random.split(jax.random.key(1), x.shape[0])
    return x * jax.vmap(lambda k: jax.random.uniform(k, x.shape[1:]))(keys)


def per_row_key_data(keys_data, x):
    keys = jax.random.wrap_key_data(keys_data)
    return x + jax.vmap(lambda k: jax.random.normal(k, x.shape[1:]))(keys)


def key_data_out(x):
    data = jax.random.key_data(jax.random.split(jax.random.key(2), x.shape[0]))
    return x * (data[:, :1] % 7).astype(x.dtype)


KEY4 = np.array([1, 2, 3, 4], np.uint32)


def per_row_gamma(x):
    keys = jax.random.split(jax.random.key(1), x.shape[0])
    return x * jax.vmap(jax.random.gamma)(keys, jnp.full(x.shape, 2.0))

ROWS = [
    # name, fn, args, input specs, output spec, collective kinds
    row("dropout_mask", dropout, [S], {"x": DM}, DM, set(),
        inner={"random_bits": DM, "lt": DM, "select_n": DM}),
    row("dropout_rows_only", dropout, [S], {"x": P("data")}, P("data"), set(), inner={"random_bits": P("data")}),
    row("key_data_input", noise_from_key_data, [KEY_DATA, S], {"x": DM}, DM, set(),
        inner={"random_wrap": P(), "random_bits": DM}),
    row("split_keys_per_row", per_row_keys, [S], {"x": DM}, DM, set(),
        inner={"random_split": P("data"), "random_bits": DM}),
    row("key_data_rows_sharded", per_row_key_data, [KEYS_DATA, S], {"keys_data": P("data")}, P("data"), set(),
        inner={"random_wrap": P("data"), "random_bits": P("data")}),
    row("key_data_unwrap", key_data_out, [S], {"x": P("data")}, P("data"), set(),
        inner={"random_split": P("data"), "random_unwrap": P("data")}),
    # random_gamma: per-key draws are parallel in the keys' dims; one key's draws stay whole
    # (the rejection sampler's while loop all-reduces its 1-byte "any row still drawing?" flag)
    row("gamma_per_row_keys", per_row_gamma, [S], {"x": P("data")}, P("data"), {"all-reduce"},
        inner={"random_gamma": P("data")}, model=set()),
    row("gamma_one_key", lambda x: x * jax.random.gamma(jax.random.key(0), jnp.ones(x.shape)), [S], {"x": DM},
        DM, {"all-reduce"}, inner={"broadcast_in_dim": P()}, model=set()),
    # rng_bit_generator: one state makes all the bits, which stay whole (sliced by their user)
    row("rng_bit_generator", lambda x: x + jax.lax.rng_bit_generator(KEY4, x.shape)[1].astype(x.dtype), [S],
        {"x": DM}, DM, set(), inner={"rng_bit_generator": P()}),
]


@pytest.mark.parametrize("r", ROWS)
def test_random(r):
    check(r)
