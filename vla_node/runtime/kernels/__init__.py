"""Triton kernels for the spots where compiled PyTorch leaves time on the table."""
