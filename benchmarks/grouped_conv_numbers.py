"""Which layouts of a grouped convolution XLA:CPU (jax 0.10.2) computes WRONG: each compared with
the unsharded result on mesh data=2 x model=4. A layout that aborts the process (a ``Check
failed`` in XLA, ``benchmarks/grouped_conv_abort.py``) is reported ABORTS: the cases run in one
subprocess, restarted past a case that kills it.

    python benchmarks/grouped_conv_numbers.py

Each row: the op (``fwd`` the grouped conv, ``dx`` its input gradient, ``dw`` its kernel
gradient: a ``batch_group_count = groups`` conv summing the examples), the groups (``16dw``: a
depthwise conv of 16 channels), where the examples are split, where the channels (the groups)
are split, and the result's layout (``free``: XLA's choice; ``repl``: replicated; ``grp``: its
channels or output features on the channels' axis). Why every program automap compiles
constrains such a conv (:mod:`automap.grouped_conv_guard`).

Measured on jax 0.10.2 (2, 4 groups of 8 channels; depthwise over 16): the kernel gradient is
WRONG whenever its examples are split on one axis alone and its channels on none, whatever the
result's layout: 4.00x with the examples on 'data', 2.00x on 'model' (the idle axis' size); right
with the examples on ('data', 'model') or ('model', 'data'), or the channels on the idle axis (2
groups on 'model' abort where the result's output features are on it too). The forward conv and
the input gradient are right in all 84 of their layouts.
"""
import ast
import itertools
import subprocess
import sys

_CASES = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
mesh = jax.make_mesh((2, 4), ("data", "model"))
for case in {cases!r}:
    op, groups, examples, channels, result = case
    chans = 16 if groups == "16dw" else 8 * groups
    g = 16 if groups == "16dw" else groups
    conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                                     feature_group_count=g)
    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(8, 6, 6, chans), jnp.float32)
    w = jnp.asarray(rng.randn(3, 3, chans // g, chans), jnp.float32)
    dy = jnp.asarray(rng.randn(8, 6, 6, chans), jnp.float32)
    fns = {{"fwd": lambda x, w, dy: conv(x, w),
           "dx": lambda x, w, dy: jax.vjp(lambda x: conv(x, w), x)[1](dy)[0],
           "dw": lambda x, w, dy: jax.vjp(lambda w: conv(x, w), w)[1](dy)[0]}}
    act = NamedSharding(mesh, P(examples, None, None, channels))
    kern = NamedSharding(mesh, P(None, None, None, channels))
    out = {{"free": None, "repl": NamedSharding(mesh, P()),
           "grp": kern if op == "dw" else act}}[result]
    f = jax.jit(fns[op], in_shardings=(act, kern, act), out_shardings=out)
    got, want = np.asarray(f(x, w, dy)), np.asarray(fns[op](x, w, dy))
    ok = np.allclose(got, want, rtol=1e-4, atol=1e-3)
    ratio = float(np.sum(np.abs(got)) / max(np.sum(np.abs(want)), 1e-30))
    print(repr(case), "correct" if ok else f"WRONG ({{ratio:.2f}}x)", flush=True)
"""


def run(cases: list[tuple]) -> dict[tuple, str]:
    """Each case's verdict: correct, WRONG (the ratio of its magnitude to the unsharded one) or ABORTS."""
    got: dict[tuple, str] = {}
    while len(got) < len(cases):
        todo = [c for c in cases if c not in got]
        done = subprocess.run([sys.executable, "-c", _CASES.format(cases=todo)], capture_output=True, text=True)
        for line in done.stdout.splitlines():
            case, _, verdict = line.partition(") ")
            got[ast.literal_eval(case + ")")] = verdict
        if done.returncode != 0:
            got[next(c for c in cases if c not in got)] = "ABORTS"
    return got


def main() -> int:
    axes = {"data": "model", "model": "data", ("data", "model"): None, ("model", "data"): None}  # the examples' axes -> the idle axis
    cases = []
    for op, groups, (examples, idle) in itertools.product(("dw", "dx", "fwd"), (2, 4, "16dw"), axes.items()):
        for channels in (None, idle) if idle else (None,):
            cases += [(op, groups, examples, channels, r) for r in ("free", "repl", "grp") if r != "grp" or channels]
    for case, verdict in run(cases).items():
        print(f"{case[0]:3} {str(case[1]):4} examples={str(case[2]):17} channels={str(case[3]):5} "
              f"result={case[4]:4} {verdict}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
