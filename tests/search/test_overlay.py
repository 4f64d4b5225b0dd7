"""The exact step's pairs of options share propagation (search.overlay): a move whose propagation
reads none of the values an earlier option changed is written over that option's state, and the
state written is the one propagating it makes, field for field."""
import itertools

import jax
import jax.numpy as jnp

import automap
import search
from automap.cost import Topology
from automap.shardings import ShardingState
from search.greedy import replay
from search.ilp import options
from search.overlay import Replayer, differing, overlay

FIELDS = ("specs", "priority", "labels", "next_priority", "frozen")


def _two_branch_space():
    """Two MLP layers on two batches, summed: the layers' propagations meet only at the loss."""
    def step(params, x, y):
        def loss(p):
            return jnp.tanh(x @ p["w1"]).sum() + jnp.tanh(y @ p["w2"]).sum()
        value, g = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value

    f32 = jnp.float32
    args = ({"w1": jax.ShapeDtypeStruct((64, 128), f32), "w2": jax.ShapeDtypeStruct((32, 64), f32)},
            jax.ShapeDtypeStruct((16, 64), f32), jax.ShapeDtypeStruct((8, 32), f32))
    t = automap.trace(step, args)
    p = automap.lower(t.closed_jaxpr, t.in_paths, t.out_paths)
    groups = [(v,) for v in p.inputs[:3]]  # w1, w2, x
    return search.SearchSpace(ShardingState.initial(p, {"data": 2, "model": 4}), topology=Topology.preset("cpu-sim"),
                              groups=groups)


def test_pairs_of_options_are_written_where_propagation_cannot_tell_them_apart():
    space = _two_branch_space()
    replayed = Replayer(space, start=())
    opts = options(space, space.root, two_axes=False, tie=False)
    for o in (o for group in opts for o in group[1:]):
        replayed(o, keep=True)  # each option alone first, as the pairwise model prices them
    pairs = [(a, b) for g, h in itertools.combinations(range(len(opts)), 2) for a in opts[g][1:] for b in opts[h][1:]]
    written = 0
    for a, b in pairs:
        first = replayed(a)[0]
        written += overlay(replayed.footprints[b[0]], first, differing(space.root, first)) is not None
        got, want = replayed(a + b)[0], replay(space, a + b)[0]  # propagated from the root
        assert all(getattr(got, f) == getattr(want, f) for f in FIELDS) and got.key() == want.key(), (a, b)
    # w1's options with w2's are written (the branches meet at the scalar loss alone); x's with w1's,
    # which meet at their dot, are propagated
    assert 0 < written < len(pairs), (written, len(pairs))
