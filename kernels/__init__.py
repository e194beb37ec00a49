"""Triton kernels, one file per op family, each with its launchers, registered ops and reference."""
