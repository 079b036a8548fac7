"""Benchmarks: varstate against its anchors (raw arrays, optax, flax nnx, orbax, numpy I/O), each printing ratios.

Run one from the repository root as a module, ``.venv/bin/python -m benchmarks.NAME``, or all with ``make bench``.
"""
