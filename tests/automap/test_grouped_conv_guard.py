"""automap.grouped_conv_guard: no program automap compiles lets XLA:CPU split a grouped conv's
kernel gradient past its groups (an abort, ``convolution_handler.cc:984``, kills the process: each
case compiles in a subprocess of its own, as ``benchmarks/grouped_conv_abort.py`` does)."""
import subprocess
import sys

import pytest

_STEP = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import automap, tactics

mesh = automap.make_mesh({{"data": 2, "model": 4}})
conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                                 feature_group_count=2)
step = lambda w, x: w - 0.1 * jax.grad(lambda w: jnp.sum(conv(x, w) ** 2))(w)  # its kernel gradient: 2 groups of 8
w = jnp.asarray(np.random.RandomState(0).randn(3, 3, 8, 16), jnp.float32)
x = jnp.asarray(np.random.RandomState(1).randn(8, 6, 6, 16), jnp.float32)
specs = {{"w": P(None, None, None, ("data", "model")), "x": P()}}  # the kernel's output features split 8 ways
if {how!r} == "jax.jit":
    f = jax.jit(step, in_shardings=tuple(NamedSharding(mesh, s) for s in specs.values()))
else:
    f = automap.automap(step, mesh=mesh, tactics=[tactics.manual(specs)], search=None, **{how})
got = f(w, x)
np.testing.assert_allclose(got, step(w, x), rtol=1e-5, atol=1e-4)
arbitration = None if {how!r} == "jax.jit" else f.plan(w, x).measured.get("arbitration")
print(sorted(c.name for c in (arbitration.kept, *arbitration.others)) if arbitration else [], "compiled")
"""


def _run(how) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _STEP.format(how=how)], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("how, want", [
    ({}, "[] compiled"),  # the plan pins nothing: its one program is the inputs-only one
    ({"pins": "all", "arbiter": "always"}, "['inputs-only', 'pinned'] compiled"),  # both programs the arbiter weighs
])
def test_no_program_automap_compiles_splits_a_kernel_gradient_past_its_groups(how, want):
    """The kernel split on its output features over ('data', 'model'), 8 ways over 2 groups: XLA's
    own propagation splits the kernel gradient's lhs batch (the channels) 8 ways and XLA:CPU
    aborts the process (``jax.jit`` given the same specs does). automap's programs constrain the
    conv to its groups' layout and compile, with the unsharded step's numbers."""
    done = _run(how)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == want


def test_jax_jit_given_the_same_specs_aborts():
    """What the guard is for: plain ``jax.jit`` of the same step and specs aborts (SIGABRT)."""
    done = _run("jax.jit")
    assert done.returncode != 0 and "new_input_batch_size % new_output_batch_size" in done.stderr


@pytest.mark.parametrize("groups, examples, batch", [
    (2, "data", 8), (2, "model", 8), (16, "data", 8),  # 16: depthwise
    (16, "data", 2),  # 2 examples: not split over all 8 devices, the conv run whole
])
def test_a_kernel_gradient_summed_over_some_axes_alone_has_the_unsharded_numbers(groups, examples, batch):
    """A grouped conv's kernel gradient under data parallelism on one axis of a 2x4 mesh (the
    other idle): the examples split, a partial kernel summed. XLA (jax 0.10.2) all-reduces such a
    conv over every device (4x the gradient on 'data', 2x on 'model', ``jax.jit`` given the same
    specs; ``benchmarks/grouped_conv_numbers.py``): automap's program splits the sum over both axes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import automap
    import tactics

    mesh = automap.make_mesh({"data": 2, "model": 4})
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),  # noqa: E731
                                                     feature_group_count=groups)
    step = lambda w, x: jax.grad(lambda w: jnp.sum(conv(x, w) ** 2))(w)  # noqa: E731
    w = jnp.asarray(np.random.RandomState(0).randn(3, 3, 16 // groups, 16), jnp.float32)
    x = jnp.asarray(np.random.RandomState(1).randn(batch, 6, 6, 16), jnp.float32)
    f = automap.automap(step, mesh=mesh, tactics=[tactics.manual({"w": P(), "x": P(examples)})], search=None)
    np.testing.assert_allclose(f(w, x), step(w, x), rtol=1e-4, atol=1e-2)


def test_a_kernel_gradient_split_further_leaves_its_producers_in_the_layout_priced():
    """Data parallelism on 'data' of a 2x4 mesh over a dense layer then a depthwise conv: the
    guard splits the conv's kernel gradient's examples over ('data', 'model'). Constrained on its
    operands alone, XLA's propagation spread that split back to the dense layer's gradient (held-out
    nnx_lora's step: 0.28x the dot FLOPs estimated); pinned in the layout priced first, XLA runs the
    FLOPs and sends the bytes estimated, with the unsharded step's numbers."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import automap
    import tactics

    def loss(params, x):
        h = jnp.tanh(x @ params["u"])
        y = jax.lax.conv_general_dilated(h, params["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                         feature_group_count=16)
        return jnp.mean(y ** 2)

    step = jax.grad(loss)
    rng = np.random.RandomState(0)
    params = {"u": jnp.asarray(rng.randn(8, 16), jnp.float32), "w": jnp.asarray(rng.randn(3, 3, 1, 16), jnp.float32)}
    x = jnp.asarray(rng.randn(8, 6, 6, 8), jnp.float32)
    f = automap.automap(step, mesh=automap.make_mesh({"data": 2, "model": 4}), search=None,
                        tactics=[tactics.data_parallel("data")])
    fid = f.verify(params, x, warn=False)
    assert fid.dot_flops.estimated == fid.dot_flops.measured > 0
    assert fid.bytes_sent.estimated == fid.bytes_sent.measured
    for a, b in zip(jax.tree.leaves(f(params, x)), jax.tree.leaves(step(params, x)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
