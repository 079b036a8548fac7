"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

assert jax.device_count() == 8, "XLA_FLAGS was set too late: jax was imported before conftest"

import pytest  # noqa: E402

import varstate  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_default_registry(monkeypatch):
    """Each test sees a new default registry, so unique names do not depend on test order."""
    monkeypatch.setattr(varstate.Registry, "_default", varstate.Registry())
