import _harness  # noqa: F401  (first: sets TRITON_INTERPRET before trifuse is imported on CPU)
