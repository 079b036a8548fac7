"""Optimizers with TF's slot and non-slot variables (see varstate/optimizers/_base.py)."""

__all__: list[str] = []
