"""Compressors of saved activations: round trips, bytes, error bounds, native kernels."""
