"""Whole networks: generated steps against their torch.nn references."""
