import _harness  # noqa: F401  (first: sets TRITON_INTERPRET before trifuse is imported on CPU)
import _device  # noqa: F401  (tests/_device.py: the interpreter's speed-only patches, as in the tests)
