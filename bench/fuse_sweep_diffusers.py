"""`trifuse.fuse` on diffusers' denoisers: every transformer (and the UNet and VAE) that
bench/diffusers_models.py builds from a tiny config, in fp32 on CPU (Triton's interpreter). Does
the fused model still run, train and give the unfused model's outputs and gradients, and what did
fuse replace? The same net as bench/fuse_sweep.py (transformers' models) and fuse_sweep_vision.py (timm,
torchvision), for the models people fine-tune for images, video and audio: their blocks modulate
norms per sample, gate residual adds, rotate q and k in a dozen spellings and route experts.

    TRITON_INTERPRET=1 python bench/fuse_sweep_diffusers.py [--jobs N] [--fp16 | --autocast]
                                                            [--via fuse|inductor] [NAME ...]
        # NAME: a key of diffusers_models.BUILDERS (e.g. flux2, hunyuan_video); named rows replace
        # theirs in the results. Default: all of them (~7 min on 2 cores with --jobs 2).
        # --fp16: the models and their inputs in fp16 (the 16-bit spellings: the casts the models
        # write around norms and rotaries), against the same float64 copy
        # --autocast: the fp32 models under bf16 autocast as a GPU runs it (tests/_fusing.py
        # `cuda_like_autocast`: the norms, softmax and pow return fp32), the fused and the unfused
        # forward alike: what mixed-precision training runs, and where fuse narrows the modulated
        # norms' outputs for the matmuls after them (fusion/narrow.py)
        # --via inductor: torch.compile(model, backend="trifuse_inductor") instead of fuse (the
        # rewritten graphs compiled by Inductor, C++ on this CPU); a MISMATCH reruns plain
        # torch.compile (no trifuse) through the same check and says so when it fails as well

Each model runs in its own process (memory-capped, timed out), dropout off, in training mode,
through the test suite's oracle (tests/_fusing.py `check_against_unfused`): the fused fp32 model's
prediction and every parameter's and input's gradient against a float64 copy, within twice what
the unfused fp32 model gets wrong plus a floor (tests/tolerances.py). fp32 rather than float64,
as in the other sweeps: the models' own `.float()` casts round a float64 model, and trifuse leaves
those spellings as written there (they would fuse in a real fp32 or 16-bit model). Statuses: "ok";
"MISMATCH" (the oracle's first complaint in "why"); "FUSED CRASH" (the unfused model ran and the
fused one raised: a trifuse bug); "build" / "unfused fails" (in float64) / "not repeatable" (two
unfused calls differ) / "timeout" are the harness's.
tests/fusion/test_fuse_diffusers.py checks a subset (in fp32 and fp16, by the oracle rule, with
the replacement counts pinned); this sweep is the wider net.
Writes bench/results/fuse_sweep_diffusers[_fp16].json and .md.
"""
import copy
import json
import os
import sys
import time
import traceback

if __name__ == "__main__" and any(a.startswith("--one=") for a in sys.argv):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import trifuse
from fuse_sweep import child_row, run_rows, save_rows

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path[:0] = [TESTS, os.path.join(TESTS, "fusion")]  # the oracle (_fusing) and the tested builders


def _prediction(out) -> torch.Tensor:
    """The denoiser's prediction from what diffusers returns: an output's `.sample`, a tuple's first
    entry, or a list of per-sample tensors (stacked)."""
    out = getattr(out, "sample", out)
    if isinstance(out, (tuple, list)):
        out = out[0] if isinstance(out, tuple) else torch.stack(out)
    return out


def run_one(name: str, dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
            via: str = "fuse") -> dict:
    import diffusers_models

    return run_build(diffusers_models.BUILDERS[name], dtype, autocast, via)


def run_build(build, dtype: torch.dtype = torch.float32, autocast: torch.dtype | None = None,
              via: str = "fuse") -> dict:
    """One model's row: `build()` returns (model, call, inputs[, train]), `call(model, *inputs)` its
    output; in training mode unless `train` is False (DiT's label embedding drops labels at random in
    training: two calls would differ). `dtype`: the model and its float inputs cast to it (fp16: the
    16-bit spellings, the casts models write around their norms and rotaries). `autocast`: both
    forwards under autocast to it, as on a GPU. `via`: "fuse", or "inductor" (the model compiled
    with backend="trifuse_inductor")."""
    from _fusing import _autocast, check_against_unfused
    from test_fuse_diffusers import Denoiser

    try:
        torch.manual_seed(0)
        model, call, inputs, *rest = build()
        train = rest[0] if rest else True
    except Exception as e:  # noqa: BLE001
        return {"status": "build", "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    inner = getattr(model, "model", model)
    for module in model.modules():  # dropout off: the check compares gradients
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    denoiser = model if isinstance(model, Denoiser) else Denoiser(model, call)
    if dtype != torch.float32:
        denoiser = denoiser.to(dtype)
        inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    params = sum(p.numel() for p in model.parameters())
    try:  # the unfused model in float64, twice: it runs, and repeats itself; in dtype (autocast), once
        twin = copy.deepcopy(denoiser).double().train(train)
        x64 = tuple(x.double() if x.is_floating_point() else x for x in inputs)
        first, second = (_prediction(twin(*x64)) for _ in range(2))
        if not torch.equal(first, second):
            return {"status": "not repeatable", "class": type(inner).__name__,
                    "why": "two unfused float64 calls differ"}
        if dtype != torch.float32 or autocast is not None:
            with _autocast(autocast):
                copy.deepcopy(denoiser).train(train)(*inputs)
    except Exception as e:  # noqa: BLE001
        return {"status": "unfused fails", "class": type(inner).__name__,
                "why": f"{type(e).__name__}: {str(e).strip()[:150]}"}
    row = {"class": type(inner).__name__, "params": params}
    compiled = []

    def compile_with(backend):  # check_against_unfused's `transform`: the model it checks
        def transform(model):
            torch._dynamo.reset()
            compiled.append(torch.compile(model, backend=backend))
            return compiled[-1]
        return transform

    check = {"train": train, "autocast": autocast}
    try:
        if via == "inductor":
            check_against_unfused(lambda: denoiser, inputs, transform=compile_with("trifuse_inductor"),
                                  **check)
            report = trifuse.report(compiled[-1])
        else:
            report = check_against_unfused(lambda: denoiser, inputs, **check)
        row["status"] = "ok"
    except AssertionError as e:
        row.update(status="MISMATCH", why=str(e).strip().splitlines()[0][:300])
        if via == "inductor":
            outcome, said = _plain_inductor(denoiser, inputs, check, compile_with("inductor"))
            why = row["why"]
            row["why"] = (f"{why} (plain torch.compile passes the same check)" if outcome == "passes" else
                          f"plain torch.compile (no trifuse) {outcome} ({said}); with trifuse: {why}")
        return row
    except Exception as e:  # noqa: BLE001
        # plain Inductor's own failure, or trifuse's?
        raises = via == "inductor" and \
            _plain_inductor(denoiser, inputs, check, compile_with("inductor"))[0] == "raises"
        return {**row, "status": "Inductor fails" if raises else "FUSED CRASH",
                "why": f"{type(e).__name__}: {str(e).strip()[:300]}",
                "traceback": traceback.format_exc()[-3000:]}
    row.update(replaced=dict(sorted(report.counts().items())),
               patterns=dict(sorted(report.by_pattern().items())), left=len(report.left()),
               left_why=sorted({f"{op}: {why}"[:100] for _, _, op, why in report.left()})[:4],
               unfused_calls={k: sum(v.values()) for k, v in report.unfused_calls().items()})
    return row


def _plain_inductor(denoiser, inputs, check: dict, transform) -> tuple[str, str]:
    """--via inductor, a MISMATCH or a crash: the same check of plain torch.compile (Inductor, no
    trifuse): ("passes", ""), ("fails the check too", its first complaint) or ("raises", the error's
    type)."""
    from _fusing import check_against_unfused

    try:
        check_against_unfused(lambda: denoiser, inputs, transform=transform, **check)
    except AssertionError as e:
        return "fails the check too", str(e).strip().splitlines()[0][:120]
    except Exception as e:  # noqa: BLE001
        return "raises", type(e).__name__
    return "passes", ""


# MISMATCH rows whose cause was found and is not trifuse's: shown in the results' "why" column
# (EXPLAINED_FP16 for the --fp16 sweep's, EXPLAINED_AUTOCAST for --autocast's).
_VAE_16_BIT = ("the model's own 16-bit ill-conditioning: its gradients (the RMS norms' gammas, the convs' "
               "weights and biases) turn ulp-level changes anywhere into errors past the oracle's 2x bound; "
               "fusing its two attentions alone, the norms left as written, fails the same check ({})")
EXPLAINED_FP16 = {
    "zimage": "the model's own fp16 overflow: the pad tokens' gradients (x_pad_token, cap_pad_token) sum "
              "over every padded position and reach inf in fp16 unfused too (the same entries); the float64 "
              "copy's do not",
    "qwenimage_vae": _VAE_16_BIT.format("a decoder gamma 2.6e-2 > 1.8e-2; over three other inputs, the norms "
                                        "fused, the median per-parameter error is the unfused one's"),
}
EXPLAINED_AUTOCAST = {
    "qwenimage_vae": _VAE_16_BIT.format("an encoder conv bias 1.30e-1 > 1.19e-1; the norms alone pass it"),
}
EXPLAINED = {
    "kandinsky5": "the model's own bf16 rounding inside an fp32 model: its rotary ends in "
                  "`.to(torch.bfloat16)`, so the fused norms' fp32-level differences flip a bf16 rounding "
                  "now and then, which the float64 twin (cast to bf16 too) does not share the same way; with "
                  "that cast made fp32, ok",
    "sana_wm": "the model's own bf16 rounding inside an fp32 model: its camera branch casts fp32 q, k and v "
               "to bf16 (padded to head dim 128) for its attention, and the oracle's fp32 floor is told "
               "nothing of it; fusing the attention alone gives the same number, the other families alone "
               "are ok, and with the casts patched out the whole model is ok (4 attentions fused)",
}


def _child(name: str, fp16: bool, timeout: int = 900, threads: int | None = None, autocast: bool = False,
           via: str = "fuse") -> dict:
    flags = [*(["--fp16"] if fp16 else []), *(["--autocast"] if autocast else []), "--via", via]
    row = child_row(__file__, [f"--one={name}", *flags], name, timeout, threads, memory_gib=10)
    explained = (EXPLAINED_FP16 if fp16 else {} if via != "fuse" else EXPLAINED_AUTOCAST if autocast
                 else EXPLAINED).get(name)
    if row.get("status") == "MISMATCH" and explained:
        row["why"] = f"{explained} (the oracle: {row.get('why', '')})"
    return row


def _markdown(rows: list[dict], header: str) -> str:
    from collections import Counter

    counts = Counter(r["status"] for r in rows)
    out = [f"# fuse sweep (diffusers)\n\n{header}\n", "| status | models |", "|---|---|"]
    out += [f"| {s} | {n} |" for s, n in counts.most_common()]
    out += ["", "| model | status | class | params | replaced | left as written | why |",
            "|---|---|---|---|---|---|---|"]
    for r in rows:
        replaced = ", ".join(f"{k} {v}" for k, v in r.get("replaced", {}).items())
        why = "; ".join([r["why"]] if r.get("why") else r.get("left_why", []))
        why = why.replace("|", "/").replace("\n", " ")[:160]
        out.append(f"| {r['type']} | {r['status']} | {r.get('class', '')} | {r.get('params', '')} | "
                   f"{replaced} | {r.get('left', '')} | {why} |")
    return "\n".join(out) + "\n"


def main(names: list[str], jobs: int, fp16: bool, autocast: bool = False, via: str = "fuse") -> None:
    import platform

    import diffusers
    import diffusers_models
    import triton

    unknown = [n for n in names if n not in diffusers_models.BUILDERS]
    if unknown:
        known = ", ".join(diffusers_models.BUILDERS)
        sys.exit(f"fuse_sweep_diffusers: no builder {unknown[0]!r} (known: {known})")
    partial = bool(names)
    names = names or list(diffusers_models.BUILDERS)
    rows = run_rows(names, lambda name, threads: _child(name, fp16, threads=threads, autocast=autocast,
                                                        via=via), jobs)
    what = "fp16" if fp16 else "fp32 under bf16 autocast (as on a GPU)" if autocast else "fp32"
    how = " through torch.compile(backend=\"trifuse_inductor\")" if via == "inductor" else ""
    header = (f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · torch {torch.__version__} · "
              f"triton {triton.__version__} · diffusers {diffusers.__version__} · "
              f"python {platform.python_version()} · CPU (TRITON_INTERPRET=1), {what}{how} "
              "against float64 by the oracle rule, training mode, dropout off")
    suffix = "_inductor" if via == "inductor" else ""
    suffix += "_fp16" if fp16 else "_bf16-autocast" if autocast else ""
    save_rows("fuse_sweep_diffusers" + suffix, rows, header, _markdown, partial)


if __name__ == "__main__":
    args = sys.argv[1:]
    one = [a for a in args if a.startswith("--one=")]
    fp16, autocast = "--fp16" in args, "--autocast" in args
    args = [a for a in args if a not in ("--fp16", "--autocast")]
    via = "fuse"
    if "--via" in args:
        i = args.index("--via")
        via = args[i + 1]
        del args[i:i + 2]
    if via not in ("fuse", "inductor") or (fp16 and autocast):
        sys.exit("fuse_sweep_diffusers: --via fuse or inductor, and --fp16 or --autocast, not both\n"
                 + __doc__)
    if one:
        row = run_one(one[0][len("--one="):], torch.float16 if fp16 else torch.float32,
                      torch.bfloat16 if autocast else None, via)
        print(json.dumps(row), flush=True)
        sys.exit(0)
    jobs = 1
    if "--jobs" in args:
        i = args.index("--jobs")
        jobs = int(args[i + 1])
        del args[i:i + 2]
    unknown = [a for a in args if a.startswith("-")]
    if unknown:
        sys.exit(f"fuse_sweep_diffusers: unknown option {unknown[0]!r}\n{__doc__}")
    main(args, jobs, fp16, autocast, via)
