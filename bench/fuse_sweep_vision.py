"""`trifuse.fuse` on the vision models people train outside transformers: one architecture of
each timm model module (ViT, DeiT, BEiT, EVA, Swin, CaiT, XCiT, PVT, MaxViT, Hiera, ConvNeXt, ...)
and torchvision's transformers (ViT, Swin, Swin V2, MaxViT, the video MViT V2), built small, in
float64 on CPU (Triton's interpreter). Does the fused model still run, train and give the unfused
model's loss and gradients, and what did fuse replace? The same net as bench/fuse_sweep.py
(transformers' models), for code written by other hands: timm's blocks call
`F.scaled_dot_product_attention` or spell the chain out (`fused_attn`), scale layers
(`LayerScale`), norm q and k, wrap norms of their own (LayerNorm2d over channels-first maps),
window and pool their tokens.

    TRITON_INTERPRET=1 python bench/fuse_sweep_vision.py [--jobs N] [--explicit-attention] [--dtype DTYPE]
                                                       [--via VIA] [NAME ...]
        # NAME: a timm model name (e.g. vit_tiny_patch16_224) or torchvision.vit / .swin / .swin_v2 /
        # .maxvit / .mvit; named rows replace theirs in the results. Default: every timm module's
        # smallest model, and the torchvision five (~40-60 min on 2 cores with --jobs 2); with another
        # DTYPE or VIA, the models whose float64 row replaced something.
        # --explicit-attention: timm's blocks with fused_attn off (TIMM_FUSED_ATTN=0): the written-out
        # softmax(q k^T) v chains instead of F.scaled_dot_product_attention
        # DTYPE: float64 (default), fp16-autocast or bf16-autocast: the model in fp32 under CPU autocast
        # (timm's --amp), held to a float64 copy by bench/fuse_sweep.py's oracle rule (the fused loss
        # and gradients at most twice as far off as the unfused ones, plus a slack per dtype), a
        # MISMATCH explained where PyTorch's own model, nudged by half an ulp, misses as far
        # VIA: fuse (default), backend (torch.compile(backend="trifuse")) or inductor ("trifuse_inductor")

Needs timm and torchvision importable (not in the test extras: torchvision's wheel must match
torch's build, and CI's CPU torch has none on PyPI; the rows in bench/results/ say which versions
ran). Each model runs in its own process (memory-capped, timed out), dropout and drop-path off, one
training step (cross-entropy over 10 classes, a batch of 2) before and after fuse, then a second
fused call. Statuses and tolerances as in bench/fuse_sweep.py ("ok": loss within 1e-6, every
gradient within 1e-5 of its parameter's largest, or of FLOOR of the model's largest; "MISMATCH";
"FUSED CRASH": the unfused model ran and the fused one raised); "build" / "unfused fails" / "not
repeatable" (two unfused steps disagree: GhostNets on torch 2.13) / "too big" / "timeout"
are the harness's.
Writes bench/results/fuse_sweep_vision[_explicit-attention][_<via>][_<dtype>].json and .md.
"""
import json
import os
import re
import sys
import time

if __name__ == "__main__" and any(a.startswith("--one=") for a in sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from fuse_sweep import (
    AUTOCAST_DTYPES,
    COMPILE_BACKENDS,
    TOLERANCES,
    _grad_error,
    _ill_conditioned,
    _inductor_alone,
    _inductor_alone_mixed,
    _non_finite,
    _oracle_error,
    child_row,
    crash_row,
    past_the_rule,
    run_rows,
    save_rows,
)

MAX_PARAMS = 35_000_000
# A gradient below this fraction of the model's largest is numerically zero and compared at it
# (bench/fuse_sweep.py's 1e-10 suits models that compute in fp32 in places): these models run in
# float64 throughout, and a BatchNorm bias before another norm (EfficientViT, InceptionNeXt) has a
# gradient that is zero in exact arithmetic and float64 rounding noise of 1e-16 to 1e-15 of the
# largest in practice, which another summation order (a fused kernel's) draws anew.
FLOOR = 1e-8
CLASSES = 10
# The smallest of a module's models by name, in this order; else the shortest name.
SIZE_WORDS = ("test", "atto", "femto", "pico", "nano", "xxs", "tiny", "xs", "mini", "s0", "b0", "m0", "t",
              "small", "s", "s1", "b1", "m1", "lite", "base")
# Image sizes tried, smallest first: a model whose constructor takes img_size is built at the first
# its forward accepts (window sizes, strides and pooling fix the rest at their defaults).
SIZES = (64, 96, 128)
# ViT variants beside each module's smallest: LayerScale (DeiT III), register tokens and global
# pooling, SigLIP's attention-pool head, AIMv2's SwiGLU and RMSNorm, rotary ViTs.
EXTRA = ("deit3_small_patch16_224", "vit_small_patch16_224", "vit_little_patch16_reg4_gap_256",
         "vit_base_patch16_siglip_224", "aimv2_large_patch14_224", "vit_medium_patch16_rope_reg1_gap_256",
         # and the small members of modules whose smallest by name is large: MetaFormer's CAFormer,
         # the MLP mixers
         "caformer_s18", "gmlp_s16_224", "mixer_s16_224", "resmlp_12_224",
         # MViT V2 with a class token (its relative positions written past the token's row and column)
         "mvitv2_small_cls")
# Tried first at each size: a ViT-like constructor's depth and width cut down (the base and large
# models of some modules are the smallest they have).
SHRINK = {"depth": 2, "embed_dim": 64, "num_heads": 2}
# Constructor arguments of models whose smallest is past MAX_PARAMS and whose constructor takes no
# SHRINK: MobileNet V5 (Gemma 3n's vision tower: RMSNorm over channels, multi-query attention
# blocks) at an eighth of its width (80.6M parameters at its own).
KWARGS = {"mobilenetv5_base": {"channel_multiplier": 0.125}}
# MISMATCH rows whose cause was found and is not trifuse's, by (dtype, model): shown in the "why" column.
EXPLAINED = {
    ("bf16-autocast", "caformer_s18"):
        "StarReLU's scalar scale and bias (stages.2.blocks.0.mlp.act), each gradient a sum over every "
        "activation that cancels 250x and 135x in float64 (sum of |terms| over |sum|): bf16's rounding "
        "upstream moves them by up to that many ulps. The 3 gradients past the rule are such scalars (scale "
        "fused 3.6e-2 off float64, unfused 8.4e-3; bias 1.9e-2, 1.3e-3). Attention alone fused, or the norms "
        "and adds alone: none past it. In fp32 the scale's fused 6.8e-6, unfused 3.7e-6 (the unfused "
        "model's worst, 8.7e-6)",
}
TORCHVISION = ("torchvision.vit", "torchvision.swin", "torchvision.swin_v2", "torchvision.maxvit",
               "torchvision.mvit")


def _size_rank(name: str) -> tuple:
    words = re.split(r"[_\-]", name)
    for i, word in enumerate(SIZE_WORDS):
        if word in words:
            return (i, len(name), name)
    return (len(SIZE_WORDS), len(name), name)


def timm_names() -> list[str]:
    """The smallest model of each timm module, by SIZE_WORDS."""
    import timm

    return sorted(min(timm.list_models(module=m), key=_size_rank) for m in timm.list_modules()
                  if timm.list_models(module=m))


def _torchvision_model(name: str) -> torch.nn.Module:
    """torchvision's transformer classifiers, built small through their public constructors."""
    from functools import partial

    from torchvision.models import maxvit, swin_transformer, vision_transformer
    from torchvision.models.video import mvit

    if name == "torchvision.vit":
        return vision_transformer.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                    hidden_dim=32, mlp_dim=64, num_classes=CLASSES)
    if name == "torchvision.swin":
        return swin_transformer.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2],
                                                num_heads=[2, 2], window_size=[4, 4], num_classes=CLASSES)
    if name == "torchvision.swin_v2":
        return swin_transformer.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[2, 2],
                                                num_heads=[2, 2], window_size=[4, 4], num_classes=CLASSES,
                                                block=swin_transformer.SwinTransformerBlockV2,
                                                downsample_layer=swin_transformer.PatchMergingV2)
    if name == "torchvision.maxvit":
        return maxvit.MaxVit(input_size=(32, 32), stem_channels=16, partition_size=2, block_channels=[16, 32],
                             block_layers=[1, 1], head_dim=8, stochastic_depth_prob=0.0, num_classes=CLASSES,
                             norm_layer=partial(torch.nn.BatchNorm2d, eps=1e-3, momentum=0.01))
    if name == "torchvision.mvit":  # the video MViT V2 (mvit_v2_s's flags), two stages, 4 x 32 x 32 clips
        blocks = [mvit.MSBlockConfig(2, 16, 16, [3, 3, 3], [3, 3, 3], [1, 1, 1], [1, 2, 2]),
                  mvit.MSBlockConfig(2, 16, 32, [3, 3, 3], [3, 3, 3], [1, 2, 2], [1, 1, 1])]
        return mvit.MViT((32, 32), 4, blocks, residual_pool=True, residual_with_cls_embed=False,
                         rel_pos_embed=True, proj_after_attn=True, num_classes=CLASSES)
    raise ValueError(f"fuse_sweep_vision: no torchvision model {name!r} (known: {', '.join(TORCHVISION)})")


def _build(name: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """(the model in float64, its input's (C, H, W)): a torchvision one at 32 x 32 (MViT's clips of 4
    frames: (C, T, H, W)), a timm one at the first of SIZES its forward runs at, else at its
    default input size. The sizes are found in float64 whatever the sweep's dtype, so that every
    dtype's row of a model runs the same shapes."""
    if name.startswith("torchvision."):
        clip = name == "torchvision.mvit"
        return _torchvision_model(name).double(), (3, 4, 32, 32) if clip else (3, 32, 32)
    import timm

    default = timm.get_pretrained_cfg(name)
    default = tuple(getattr(default, "input_size", None) or (3, 224, 224)) if default else (3, 224, 224)
    attempts = [(size, shrink) for size in (*SIZES, None) for shrink in (SHRINK, {})
                if size is None or size < default[1]]
    for size, shrink in attempts:
        try:
            kwargs = {**KWARGS.get(name, {}), **shrink, **({} if size is None else {"img_size": size})}
            torch.manual_seed(0)
            model = timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs).double()
            shape = default if size is None else (default[0], size, size)
            with torch.no_grad():
                model.eval()(torch.randn(1, *shape, dtype=torch.float64))
            return model, shape
        except Exception:  # (no img_size, or a size its windows do not divide: the next; the last re-raised)
            if (size, shrink) == attempts[-1]:
                raise
    raise AssertionError("unreachable")


def run_one(name: str, dtype: str = "float64", via: str = "fuse") -> dict:
    """One model's row: its training step unfused, then through `via` (fuse, or torch.compile with
    trifuse's backend or trifuse + Inductor), in `dtype`: float64, or fp32 under CPU autocast
    (fp16- / bf16-autocast) held to bench/fuse_sweep.py's oracle rule against a float64 copy."""
    import copy

    import trifuse

    try:
        model, shape = _build(name)
    except Exception as e:  # noqa: BLE001
        return {"status": "build", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    for module in model.modules():  # dropout and drop-path off, as the sweep compares gradients
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if hasattr(module, "drop_prob") and isinstance(module.drop_prob, float):  # timm's DropPath
            module.drop_prob = 0.0
        if type(module).__name__ == "StochasticDepth":  # torchvision's (Swin's default rate is 0.2)
            module.p = 0.0
    params = sum(p.numel() for p in model.parameters())
    if params > MAX_PARAMS:
        return {"status": "too big", "why": f"{params} parameters"}
    mixed = dtype in AUTOCAST_DTYPES
    # Under autocast: the model in fp32, as a user trains in mixed precision, its float64 copy the oracle,
    # and an unfused copy kept for the MISMATCH explanations (fuse rewrites the model in place).
    model64 = copy.deepcopy(model).train() if mixed else None
    model = model.float() if mixed else model
    unfused = copy.deepcopy(model).train() if mixed else None
    torch.manual_seed(1)
    images64 = torch.randn(2, *shape, dtype=torch.float64)
    images = images64.float() if mixed else images64
    labels = torch.tensor([3, 7])
    leaves = [p for p in model.parameters() if p.requires_grad]
    model.train()
    loss_tol, grad_tol, floor = TOLERANCES[dtype]
    floor = floor if mixed else FLOOR
    autocast = torch.autocast("cpu", dtype=AUTOCAST_DTYPES.get(dtype, torch.float16), enabled=mixed)

    def loss_of(m: torch.nn.Module, x: torch.Tensor = images) -> torch.Tensor:
        torch.manual_seed(1234)  # a model's own draws in training, the same fused and unfused
        out = m(x)
        out = out[0] if isinstance(out, (tuple, list)) else out  # distilled heads: (class, distillation)
        return torch.nn.functional.cross_entropy(out if out.dtype == torch.float64 else out.float(), labels)

    try:
        with autocast:
            loss0 = loss_of(model)
        grads0 = torch.autograd.grad(loss0, leaves, allow_unused=True)
        with autocast:
            again = loss_of(model)
        again = _grad_error(grads0, torch.autograd.grad(again, leaves, allow_unused=True), floor)
        if mixed:  # the oracle: the same model and batch in float64
            loss64 = loss_of(model64, images64)
            grads64 = torch.autograd.grad(loss64, [p for p in model64.parameters() if p.requires_grad],
                                          allow_unused=True)
            del model64
    except Exception as e:  # noqa: BLE001
        return {"status": "unfused fails", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    if again >= grad_tol:
        return {"status": "not repeatable",
                "why": f"two unfused steps' gradients differ by {again:.2g}: no baseline"}
    try:
        fused = trifuse.fuse(model) if via == "fuse" else torch.compile(model, backend=COMPILE_BACKENDS[via])
        with autocast:
            loss1 = loss_of(fused)
        grads1 = torch.autograd.grad(loss1, leaves, allow_unused=True)
        with autocast:
            loss2 = loss_of(fused).detach()
    except Exception as e:  # noqa: BLE001
        return crash_row(e, model, loss_of, autocast, via)
    loss0, loss1 = loss0.detach(), loss1.detach()
    loss_err = abs(float(loss1) - float(loss0)) / max(abs(float(loss0)), 1e-30)
    grad_err = _grad_error(grads0, grads1, floor)
    if mixed:
        l0, l1, l64 = float(loss0), float(loss1), float(loss64.detach())
        excess = _oracle_error(grads0, grads1, grads64, floor, grad_tol)
        loss_excess = abs(l1 - l64) - 2 * abs(l0 - l64) - loss_tol * abs(l64)
        ok = loss_excess <= 0 and excess <= 0
    else:
        ok = loss_err < loss_tol and grad_err < grad_tol
    ok = ok and float(loss2) == float(loss1)
    report = trifuse.report(fused)
    row = {"status": "ok" if ok else "MISMATCH", "input": "x".join(map(str, shape[1:])), "params": params,
           "loss_rel_err": loss_err, "grad_rel_err": grad_err,
           "replaced": dict(sorted(report.counts().items())), "left": len(report.left()),
           "left_why": sorted({f"{op}: {why}"[:100] for _, _, op, why in report.left()})[:4],
           "unfused_calls": {k: sum(v.values()) for k, v in report.unfused_calls().items()}}
    whys = []
    if mixed:
        row["oracle_excess"] = excess
        if not ok and excess > 0 and loss_excess <= 0 and float(loss2) == float(loss1):
            whys.append(_ill_conditioned(unfused, loss_of, autocast, grads0, grads1, grads64, floor,
                                         grad_tol))
        trainable = [(n, p) for n, p in unfused.named_parameters() if p.requires_grad]
        if not ok and via == "inductor" and (excess > 0 or loss_excess > 0):  # (the rule broken)
            alone = _inductor_alone_mixed(unfused, loss_of, [p for _, p in trainable], autocast, (l0, l64),
                                          grads0, grads64, floor, loss_tol, grad_tol, (loss_excess, excess))
            whys.append(alone.pop("why", ""))
            row.update(alone)
        if not any(whys):
            whys.append(past_the_rule([n for n, _ in trainable], grads0, grads1, grads64, floor, grad_tol))
    elif not ok and via == "inductor":
        alone = _inductor_alone(model, loss_of, leaves, loss0, grads0, floor, (loss_err, grad_err),
                                (loss_err >= loss_tol, grad_err >= grad_tol))
        whys.append(alone.pop("why", ""))
        row.update(alone)
    if _non_finite(grads0):
        whys.append(f"the unfused model's gradients hold {_non_finite(grads0)} NaN/inf entries "
                    "(compared by place)")
    if any(whys):
        row["why"] = "; ".join(w for w in whys if w)
    return row


def _child(name: str, explicit: bool, dtype: str, via: str, timeout: int = 900,
           threads: int | None = None) -> dict:
    timeout = timeout * 3 if via == "inductor" else timeout  # Inductor: C++ compiles
    return child_row(__file__, [f"--one={name}", f"--dtype={dtype}", f"--via={via}"], name, timeout, threads,
                     memory_gib=10, env={"TIMM_FUSED_ATTN": "0" if explicit else "1"})


def _markdown(rows: list[dict], header: str, dtype: str = "float64") -> str:
    from collections import Counter

    counts = Counter(r["status"] for r in rows)
    excess = any("oracle_excess" in r for r in rows)  # an autocast sweep: the oracle rule's verdict too
    out = [f"# fuse sweep (timm and torchvision)\n\n{header}\n", "| status | models |", "|---|---|"]
    out += [f"| {s} | {n} |" for s, n in counts.most_common()]
    out += ["", "| model | status | input | replaced | left as written | loss rel err | max grad rel err "
            + ("| gradients' excess over the rule " if excess else "") + "| why |",
            "|---|---|---|---|---|---|---|" + ("---|" if excess else "") + "---|"]
    for r in rows:
        replaced = ", ".join(f"{k} {v}" for k, v in r.get("replaced", {}).items())
        err = (f"{r['loss_rel_err']:.2g}", f"{r['grad_rel_err']:.2g}") if "loss_rel_err" in r else ("", "")
        if excess:
            err += (f"{r['oracle_excess']:.2g}" if "oracle_excess" in r else "",)
        why = "; ".join([r["why"]] if r.get("why") else r.get("left_why", []))
        why = why.replace("|", "/").replace("\n", " ")
        # (an error message or what fuse left: its start; the sweep's own verdicts whole)
        why = why if why.startswith(("ill-conditioned", "plain torch.compile")) else why[:160]
        if r["status"] == "MISMATCH" and (dtype, r["type"]) in EXPLAINED:
            why = "; ".join(w for w in (why, EXPLAINED[dtype, r["type"]]) if w)
        out.append(f"| {r['type']} | {r['status']} | {r.get('input', '')} | {replaced} | "
                   f"{r.get('left', '')} | {' | '.join(err)} | {why} |")
    return "\n".join(out) + "\n"


def fused_in_float64() -> list[str]:
    """The models whose float64 row (bench/results/fuse_sweep_vision.json) replaced something: what an
    autocast or compile sweep runs by default (a model trifuse leaves alone runs as PyTorch's)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fuse_sweep_vision.json")
    with open(path) as f:
        return [r["type"] for r in json.load(f)["rows"] if r.get("replaced")]


def main(names: list[str], jobs: int, explicit: bool, dtype: str = "float64", via: str = "fuse") -> None:
    import platform

    import timm
    import torchvision
    import triton

    partial = bool(names)
    if not names:
        plain = dtype == "float64" and via == "fuse"
        names = [*timm_names(), *EXTRA, *TORCHVISION] if plain else fused_in_float64()
    rows = run_rows(names, lambda name, threads: _child(name, explicit, dtype, via, threads=threads), jobs)
    precision = ("float64" if dtype == "float64" else
                 f"fp32 under CPU {dtype.split('-')[0]} autocast, held to a float64 copy (the oracle rule)")
    header = (f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · torch {torch.__version__} · "
              f"triton {triton.__version__} · timm {timm.__version__} · "
              f"torchvision {torchvision.__version__} · "
              f"python {platform.python_version()} · CPU (TRITON_INTERPRET=1), {precision}, "
              "one training step, dropout off"
              + (f", through torch.compile(backend={COMPILE_BACKENDS[via]!r})" if via != "fuse" else "")
              + (", timm's attention written out (TIMM_FUSED_ATTN=0)" if explicit else ""))
    stem = ("fuse_sweep_vision" + ("_explicit-attention" if explicit else "")
            + (f"_{via}" if via != "fuse" else "") + (f"_{dtype}" if dtype != "float64" else ""))
    save_rows(stem, rows, header, lambda rows, header: _markdown(rows, header, dtype), partial)


def _option(args: list[str], name: str, default: str, choices) -> str:
    """`--name=value` or `--name value` taken out of `args`, checked against `choices`."""
    value = default
    for i, a in enumerate(args):
        if a == f"--{name}" and i + 1 < len(args):
            value = args.pop(i + 1)
            args.pop(i)
            break
        if a.startswith(f"--{name}="):
            value = args.pop(i).split("=", 1)[1]
            break
    if value not in choices:
        sys.exit(f"fuse_sweep_vision: --{name} {value!r}: expected one of {', '.join(choices)}")
    return value


if __name__ == "__main__":
    args = sys.argv[1:]
    dtype = _option(args, "dtype", "float64", TOLERANCES)
    via = _option(args, "via", "fuse", ("fuse", *COMPILE_BACKENDS))
    one = [a for a in args if a.startswith("--one=")]
    if one:
        print(json.dumps(run_one(one[0][len("--one="):], dtype, via)), flush=True)
        sys.exit(0)
    jobs = 1
    if "--jobs" in args:
        i = args.index("--jobs")
        jobs = int(args[i + 1])
        del args[i:i + 2]
    explicit = "--explicit-attention" in args
    args = [a for a in args if a != "--explicit-attention"]
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        sys.exit(f"fuse_sweep_vision: unknown option {unknown[0]!r}\n{__doc__}")
    main(args, jobs, explicit, dtype, via)
