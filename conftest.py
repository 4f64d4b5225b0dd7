"""Simulate 8 devices on the CPU for every test and doctest (must run before JAX initialises)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
