"""Simulate 8 devices on the CPU for every test and doctest (must run before JAX initialises).

The tests compile many small programs and check what XLA's partitioner makes of them (collectives,
buffer sizes, results), none of which depends on how hard the CPU backend optimises the machine
code it emits: ``--xla_backend_optimization_level=0`` halves each compile (zoo 2-layer GPT train
step: 11.9 s -> 6.4 s) and leaves the compiled collectives and memory unchanged. Tests that start a
Python subprocess (or a notebook kernel) hand it the same flag."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
