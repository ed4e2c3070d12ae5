"""Prefill/decode disaggregation: the pieces shared by P, D and the coordinator.

Nothing in this package imports torch, `mindie._C` or the engine at module level, so the
coordinator (which only routes requests) can load it.
"""
