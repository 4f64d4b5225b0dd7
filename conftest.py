"""Simulate 8 devices on the CPU for every test and doctest (must run before JAX initialises).

The tests compile many small programs and check what XLA's partitioner makes of them (collectives,
buffer sizes, results), none of which depends on how hard the CPU backend optimises the machine
code it emits: ``--xla_backend_optimization_level=0`` halves each compile (zoo 2-layer GPT train
step: 11.9 s -> 6.4 s) and leaves the compiled collectives and memory unchanged. Tests that start a
Python subprocess (or a notebook kernel) hand it the same flag."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The modules whose tests each run a subprocess or a notebook kernel for half a minute to two
# minutes on 2 cores. pytest-xdist hands tests out in collection order, in chunks; collected last
# (tests/test_*.py sort after tests/tactics/), they ran at the very end, one of them on one worker
# while the other worker's queue was short tests. Collected first, a run's tail is short tests on
# both workers (measured: per-test durations sum to 2 x 908 s in a 932 s run; the suite is
# CPU-bound, so the wall time gained is small). Order only: every test still runs, and these
# modules share no cached state with the others.
FIRST = ("tests/test_notebooks.py", "tests/benchmarks/test_megatron_quick.py", "tests/automap/test_multihost.py",
         "tests/test_readme.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in FIRST)  # stable: the rest keep their order
