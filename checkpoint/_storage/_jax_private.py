"""The one module of `checkpoint._storage` that reads JAX internals (``jax._src``): placing a host value.

- `host_put()`: ``jax.device_put(host, sharding)`` of one aligned NumPy array
  onto one device, through the call `jax.device_put` itself ends in.
  `jax.device_put`'s Python costs about 25 us an array before that call,
  which takes 4 us: for a restore of 1,500 small values, 25-30 of its
  95-100 ms. It is checked once against `jax.device_put` and used only if
  it places alike; a JAX without these internals places through
  `jax.device_put`, as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

# (module, name): JAX's abstract value of an array, and the placing call under `jax.device_put`
INTERNALS = (("jax._src.core", "ShapedArray"), ("jax._src.lib", "xla_client.batched_device_put"))
AVALS_KEPT = 4096  # abstract values cached by (shape, dtype); a process restoring ever new shapes clears them

Put = Callable[[np.ndarray, Any], Any]
_PUT: list[Put | None] = []  # the one `host_put`, made on first use


def host_put() -> Put | None:
    """A function `(host, sharding) -> jax.Array`, or None for a value it leaves to `jax.device_put` (a dtype JAX
    would change, a memory other than the device's own); None itself where this JAX lacks the internals or they
    place otherwise than `jax.device_put`. `host` is C-contiguous and 64-byte aligned, `sharding` a
    `SingleDeviceSharding`; on CPU the array shares the host buffer, as `jax.device_put`'s does."""
    if not _PUT:
        try:
            shaped, batched = (internal(module, name) for module, name in INTERNALS)
        except (ImportError, AttributeError):
            _PUT.append(None)
        else:
            _PUT.append(checked_put(shaped, batched))
    return _PUT[0]


def internal(module: str, name: str) -> Any:
    """`module`'s attribute `name` (dotted: ``xla_client.batched_device_put``)."""
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def checked_put(shaped: Callable[..., Any], batched: Callable[..., Any]) -> Put | None:
    """`host_put` made of `shaped` (the abstract value type) and `batched` (the placing call), if it places as
    `jax.device_put` does: abstract value, sharding, committed, values."""
    avals: dict[tuple[tuple[int, ...], np.dtype], Any] = {}
    numeric: dict[np.dtype, bool] = {}  # JAX holds the dtype (strings and records it refuses, with its message)

    def put(host: np.ndarray, sharding: Any) -> Any:
        dtype = host.dtype
        ok = numeric.get(dtype)
        if ok is None:
            ok = numeric[dtype] = dtype == np.bool_ or bool(jax.dtypes.issubdtype(dtype, np.number))
        # int64 is not kept without 64-bit types: jax.device_put makes it int32
        kept = ok and jax.dtypes.canonicalize_dtype(dtype) == dtype
        (device,) = sharding.device_set
        try:
            default = device.default_memory().kind
        except (RuntimeError, AttributeError, NotImplementedError):  # a backend without memory kinds
            return None
        if not kept or sharding.memory_kind != default:
            return None
        aval = avals.get((host.shape, dtype))
        if aval is None:
            if len(avals) >= AVALS_KEPT:
                avals.clear()
            aval = avals[host.shape, dtype] = shaped(host.shape, dtype)
        return batched(aval, sharding, [host], [device], True)

    probe = np.array([1.0, -2.0, 3.5], np.float32)  # what is compared holds aligned or not (no buffer sharing)
    try:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        ours, theirs = put(probe, sharding), jax.device_put(probe, sharding)
        same = (ours is not None and ours.aval == theirs.aval and ours.sharding == theirs.sharding
                and ours.committed == theirs.committed and np.array_equal(np.asarray(ours), np.asarray(theirs)))
    except Exception:  # any failure of the internals means: place through jax.device_put
        same = False
    return put if same else None
