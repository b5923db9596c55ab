"""Tensor-parallel communication: TPGroup (tp_group.py)."""
