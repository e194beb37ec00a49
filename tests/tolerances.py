"""The one oracle rule and its numbers, for every op (FlashAttention's test rule).

An output passes when its largest error against the float64 reference is at most ERR_FACTOR
times PyTorch's own largest error (the same maths run by PyTorch in the low-precision dtype),
plus a per-dtype floor scaled by the reference's magnitude:

    max|out - ref64|  <=  ERR_FACTOR * max|ref_lowp - ref64|  +  FLOOR[dtype] * max(1, max|ref64|)

NaN and inf must sit where the reference has them. No test writes its own tolerance; a number
here changes only with a comment saying why. Every use has a negative control: a plausible wrong
implementation that must fail the same check (see `check_close`).
"""
import torch


# bf16 everywhere: on CPU, the interpreter computes on bf16 values as a GPU does
# (kernels/_interpreter.py corrects Triton's own, which computed on the raw bits).
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)

ERR_FACTOR = 2.0

FLOOR: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,  # fp32 accumulation over a few thousand terms
    torch.float16: 1e-3,  # about 2 ulp at 1.0
    torch.bfloat16: 1e-2,  # about 2 ulp at 1.0
}


def max_error(a: torch.Tensor, ref64: torch.Tensor) -> float:
    """Largest absolute difference over the finite entries of the reference."""
    finite = torch.isfinite(ref64)
    if not finite.any():
        return 0.0
    return (a.to(torch.float64)[finite] - ref64[finite]).abs().max().item()


def check_close(
    name: str, out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor | None,
    compute_dtype: torch.dtype | None = None,
) -> tuple[bool, str]:
    """(passed, message) for the rule above. `ref_lowp` None means PyTorch has no low-precision
    version of this computation: its error is then taken as the rounding of ref64 to out's dtype.
    `compute_dtype` names the narrowest dtype the output was computed from when that is narrower
    than out's own (autocast's fp32 weight gradient of bf16 activations): the floor is that
    dtype's, since out's precision then says nothing about the rounding upstream of it."""
    out = out.detach()
    ref64 = ref64.detach().to(torch.float64)
    if out.shape != ref64.shape:
        return False, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref64.shape)}"
    if ref_lowp is None:
        ref_lowp = ref64.to(out.dtype)
    ref_lowp = ref_lowp.detach()
    out_nonfinite = ~torch.isfinite(out.to(torch.float64))
    ref_nonfinite = ~torch.isfinite(ref64)
    if not torch.equal(out_nonfinite, ref_nonfinite):
        return False, f"{name}: NaN/inf at {int((out_nonfinite ^ ref_nonfinite).sum())} places the reference does not have them"
    if ref_nonfinite.any() and not torch.equal(out.to(torch.float64)[ref_nonfinite], ref64[ref_nonfinite]):
        if not torch.equal(torch.isnan(out.to(torch.float64)), torch.isnan(ref64)):
            return False, f"{name}: NaN where the reference has inf (or the reverse)"
    if out.numel() == 0:
        return True, f"{name}: empty"
    err = max_error(out, ref64)
    torch_err = max_error(ref_lowp, ref64)
    scale = max(1.0, ref64[~ref_nonfinite].abs().max().item() if (~ref_nonfinite).any() else 1.0)
    floor_dtype = out.dtype
    if compute_dtype is not None and FLOOR[compute_dtype] > FLOOR[out.dtype]:
        floor_dtype = compute_dtype
    bound = ERR_FACTOR * torch_err + FLOOR[floor_dtype] * scale
    ok = err <= bound
    return ok, f"{name}: max error {err:.3e} {'<=' if ok else '>'} bound {bound:.3e} (PyTorch's own {torch_err:.3e}, {floor_dtype})"


def assert_close(
    name: str, out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor | None,
    compute_dtype: torch.dtype | None = None,
) -> None:
    """Fails the test unless `out` passes the rule above against `ref64`."""
    ok, msg = check_close(name, out, ref64, ref_lowp, compute_dtype)
    assert ok, msg
