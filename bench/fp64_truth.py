"""Is a float64 MISMATCH of `fuse_sweep.py` trifuse's error or the model's own fp32 arithmetic?

Hugging Face models compute parts in fp32 on purpose (`x.float()`, `.to(torch.float32)`,
`softmax(..., dtype=torch.float32)`): in a float64 model those are casts *down*, so the unfused
float64 model is not a float64 computation, and its gradients carry fp32 rounding wherever it
does that. trifuse's norms and loss read the tensor before such a cast and compute at its own
precision (float64 for float64 inputs; patterns/layer_norm.py, patterns/cross_entropy.py), so
fused and unfused then agree only to the model's fp32 level. This script measures that level.

    TRITON_INTERPRET=1 python bench/fp64_truth.py MODEL_TYPE [MODEL_TYPE ...] [--ops FAMILY,FAMILY] [--task TASK]

Per type (causal LM unless --task says another of fuse_sweep's tasks) (built as fuse_sweep builds it: tiny config, float64, one training step,
dropout off), the largest relative gradient error (as fuse_sweep measures it) and the loss's:
    fused vs unfused        what fuse_sweep judges (1e-5)
    unfused vs truth        the model's own fp32 parts. The truth is the unfused model run inside
                            Float64Throughout: its fp32 casts and dtypes made float64
    fused vs truth          the fused model as it runs (never inside Float64Throughout: Dynamo
                            recaptures the blocks under a new mode, reaches its recompile limit
                            and runs most of them unfused, so that comparison would be void)
    unfused, perturbed      the unfused model with its fp32 cross-entropy computed by another fp32
                            formula (logsumexp minus the target's logit): how far a change at fp32
                            rounding level moves its gradients, whoever makes it
and the trifuse ops one fused step ran (profiled), with the parameters worst hit. When
"fused vs unfused" is no larger than "unfused vs truth" and "unfused, perturbed", the mismatch
is the model's fp32 noise, not a trifuse error; a trifuse error (a path that drops to fp32, or
a replacement with another formula) shows as "fused vs truth" well above "unfused vs truth".
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before trifuse: the Triton kernels run on CPU

import argparse  # noqa: E402
import contextlib  # noqa: E402
import copy  # noqa: E402
import sys  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fuse_sweep  # noqa: E402


def _widen(v):
    if v is torch.float32:
        return torch.float64
    if isinstance(v, (list, tuple)):
        return type(v)(_widen(x) for x in v)
    return v


class Float64Throughout(torch.overrides.TorchFunctionMode):
    """Inside it, the fp32 casts and dtypes a model writes (`x.float()`, `.to(torch.float32)`,
    `softmax(..., dtype=torch.float32)`, `.type_as(an fp32 tensor)`, `zeros(..., dtype=torch.float32)`)
    become float64: a float64 model then computes in float64 throughout. For eager, unfused
    models only (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        elif func is torch.Tensor.type_as and len(args) == 2 and args[1].dtype == torch.float32:
            args = (args[0], args[1].double())
        return func(*_widen(tuple(args)), **{k: _widen(v) for k, v in kwargs.items()})


_F_CROSS_ENTROPY = F.cross_entropy


def _cross_entropy_other_fp32(logits: torch.Tensor, target: torch.Tensor, weight=None, size_average=None,
                              ignore_index: int = -100, reduce=None, reduction: str = "mean",
                              label_smoothing: float = 0.0) -> torch.Tensor:
    """F.cross_entropy on (N, C) class indices as logsumexp minus the target's logit: the same
    function, rounded differently (no weights, no label smoothing)."""
    if weight is not None or label_smoothing or logits.dim() != 2 or reduction not in ("mean", "sum"):
        return _F_CROSS_ENTROPY(logits, target, weight, size_average, ignore_index, reduce, reduction,
                                label_smoothing)
    keep = target != ignore_index
    # where(), not clamp(): QA's ignore_index (the sequence length) lies past the classes
    picked = logits.gather(-1, torch.where(keep, target, 0)[:, None])[:, 0]
    per_row = (torch.logsumexp(logits, -1) - picked) * keep
    return per_row.sum() / keep.sum() if reduction == "mean" else per_row.sum()


@contextlib.contextmanager
def other_fp32_cross_entropy() -> Iterator[None]:
    """Within it, `torch.nn.functional.cross_entropy` (which transformers' loss calls on its fp32
    copy of the logits) is `_cross_entropy_other_fp32`."""
    F.cross_entropy = _cross_entropy_other_fp32
    try:
        yield
    finally:
        F.cross_entropy = _F_CROSS_ENTROPY


def _build(model_type: str, task: str = "causal-lm") -> tuple[torch.nn.Module, dict]:
    """The float64 model and batch fuse_sweep.run_one makes for a type and task."""
    import transformers as tf

    tf.logging.set_verbosity_error()
    for attn in ("sdpa", "eager"):
        cfg = fuse_sweep._config(tf, model_type, attn, task)
        torch.manual_seed(0)
        try:
            model = fuse_sweep._auto_class(tf, task).from_config(cfg).double()
        except Exception as e:  # noqa: BLE001
            if attn == "sdpa" and "does not support an attention implementation" in str(e):
                continue
            raise
        model.train()
        return model, fuse_sweep.batch(model, task)
    raise RuntimeError(f"{model_type}: no attention implementation builds")


def _step(model: torch.nn.Module, kwargs: dict, task: str = "causal-lm") -> tuple[float, tuple]:
    leaves = [p for p in model.parameters() if p.requires_grad]
    loss = fuse_sweep._loss(fuse_sweep._seeded(model)(**kwargs), task)
    return float(loss), torch.autograd.grad(loss, leaves, allow_unused=True)


def _worst(names: list[str], ref: tuple, got: tuple, k: int = 3) -> str:
    errs = [(float((a - b).abs().max()) / float(a.abs().max()), n) for n, a, b in zip(names, ref, got)
            if a is not None and b is not None and float(a.abs().max()) > 1e-12]
    return ", ".join(f"{n} {e:.2g}" for e, n in sorted(errs, reverse=True)[:k])


def measure(model_type: str, ops: list[str] | None = None, task: str = "causal-lm") -> dict:
    """The comparisons in the module docstring for one type of a task, fused with `ops` (None:
    every family). Returns {name: (loss rel err, max grad rel err, worst parameters)} and the
    trifuse ops one fused training step ran ("trifuse_ops")."""
    import trifuse

    model, kwargs = _build(model_type, task)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    unfused = _step(model, kwargs, task)
    with Float64Throughout():
        truth = _step(copy.deepcopy(model), kwargs, task)
    with other_fp32_cross_entropy():
        perturbed = _step(model, kwargs, task)
    trifuse.fuse(model, ops=ops)
    fused = _step(model, kwargs, task)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, kwargs, task)
    ran = Counter(e.name for e in prof.events() if e.name.startswith("trifuse::"))

    def compare(ref, got):
        loss_err = abs(got[0] - ref[0]) / max(abs(ref[0]), 1e-30)
        return loss_err, fuse_sweep._grad_error(ref[1], got[1]), _worst(names, ref[1], got[1])

    return {"fused vs unfused": compare(unfused, fused), "unfused vs truth": compare(truth, unfused),
            "fused vs truth": compare(truth, fused), "unfused, perturbed": compare(unfused, perturbed),
            "trifuse_ops": dict(ran)}


def test_fp64_truth_smoke():
    """Llama's norms compute in fp32 in the model and in float64 fused: the fused model is closer
    to the float64 truth than the unfused one (`pytest bench/fp64_truth.py`)."""
    r = measure("llama")
    assert r["trifuse_ops"].get("trifuse::rms_norm", 0) > 0
    assert r["fused vs truth"][1] < r["unfused vs truth"][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("types", nargs="+", help="model types (transformers' config names)")
    parser.add_argument("--task", default="causal-lm", choices=fuse_sweep.TASKS)
    parser.add_argument("--ops", help="families to fuse, comma-separated (default: all)")
    args = parser.parse_args()
    ops = args.ops.split(",") if args.ops else None
    for model_type in args.types:
        r = measure(model_type, ops, args.task)
        print(f"{model_type} (ops {ops or 'all'}); trifuse ops a fused step ran: {r.pop('trifuse_ops')}")
        for name, (loss_err, grad_err, worst) in r.items():
            print(f"  {name:20s} loss {loss_err:.2g}  grads {grad_err:.2g}  worst: {worst}")


if __name__ == "__main__":
    main()
