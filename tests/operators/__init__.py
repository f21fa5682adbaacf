"""Operator families end to end: generated float64 gradients against torch.autograd."""
