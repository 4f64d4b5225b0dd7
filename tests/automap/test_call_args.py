"""Keyword arguments in calls and static_argnames, as jax.jit takes them: the results equal
jax.jit's, the plan is the one for the same arguments given by position."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import automap

MESH = automap.make_mesh({"data": 2, "model": 4})
W = np.linspace(-1, 1, 16 * 8, dtype=np.float32).reshape(16, 8)
X = np.linspace(0, 1, 8 * 16, dtype=np.float32).reshape(8, 16)


def raises(exc, *fragments):
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


def step(w, x, scale=2.0, train=True):
    y = jnp.tanh(x @ w) * scale
    return (y.sum() if train else y.mean()), w * 0.5


def close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("args, kwargs", [
    ((W,), {"x": X}),
    ((), {"x": X, "w": W}),
    ((W, X), {"scale": 3.0}),
    ((W,), {"x": X, "train": False}),  # scale, skipped, takes its default
    ((W, X), {"train": True}),
])
def test_keyword_arguments_equal_jax_jit(args, kwargs):
    f = automap.partition(step, mesh=MESH, search=None, static_argnames="train")
    want = jax.jit(step, static_argnames="train")(*args, **kwargs)
    close(f(*args, **kwargs), want)
    positional = f._binder.bind(args, kwargs)  # what the keywords bound to
    assert f.plan(*args, **kwargs) is f.plan(*positional)
    assert f.lower(*args, **kwargs).as_text() == f.lower(*positional).as_text()


def test_keywords_and_positions_share_one_plan():
    f = automap.partition(step, mesh=MESH, search=None)
    assert f.plan(W, X) is f.plan(W, x=X) is f.plan(x=X, w=W)
    assert f.plan(W, X).traced.in_paths == ("w", "x")


def test_static_argnames_are_static():
    f = automap.partition(step, mesh=MESH, search=None, static_argnames=("train",))
    assert f.static_argnums == (3,)
    plan = f.plan(W, X, 1.5, train=False)  # `if train:` needs a Python bool: it is not traced
    assert plan.traced.in_paths == ("w", "x", "scale")
    assert f.plan(W, X, 1.5, False) is plan
    assert f.plan(W, X, 1.5, True) is not plan
    close(f(W, X, 1.5, train=False), step(W, X, 1.5, train=False))
    both = automap.partition(step, mesh=MESH, search=None, static_argnums=(2,), static_argnames="train")
    assert both.static_argnums == (2, 3) and both.plan(W, X, 1.5, True).traced.in_paths == ("w", "x")


def kw_only(w, x, *, scale=1.0):
    return x @ w * scale


@pytest.mark.parametrize("options, call, exc, fragments", [
    ({}, {"y": X}, ValueError, ["keyword argument names 'y'", "no such parameter", "['w', 'x', 'scale', 'train']"]),
    ({}, {"w": W}, TypeError, ["multiple values for argument 'w'"]),
    ({"static_argnames": "training"}, {}, ValueError, ["static_argnames names 'training'", "no such parameter"]),
    ({"static_argnames": [3]}, {}, TypeError, ["static_argnames must be parameter names", "3"]),
])
def test_bad_keywords_are_named(options, call, exc, fragments):
    with raises(exc, *fragments):
        automap.partition(step, mesh=MESH, search=None, **options).plan(W, X, **call)


def test_keyword_only_parameters_are_named():
    with raises(ValueError, "'scale'", "keyword-only", "functools.partial"):
        automap.partition(kw_only, mesh=MESH, search=None).plan(W, X, scale=2.0)
    with raises(ValueError, "static_argnames names 'scale'", "keyword-only"):
        automap.partition(kw_only, mesh=MESH, static_argnames="scale")
