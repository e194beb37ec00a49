"""Tune a model's shapes ahead of training and print the winners.

    python -m trifuse.autotune MODEL_SPEC --batch B --seq S [--dtype bf16] [--export-defaults PATH]

MODEL_SPEC is one of
    gpt2, bert, ...               a transformers model type, built offline from its config class
                                  (random weights; no download)
    gpt2-medium, bert-large, ...  the same with published sizes (PRESETS below)
    gpt2:n_layer=2,n_embd=64      a model type or preset with config overrides
    path/to/config.json           a transformers config file (or a directory holding one)
    path/to/file.py:factory       factory(batch=B, seq=S) (or factory()) returning a model, or
                                  (model, inputs) where inputs is a tuple of positional tensors

It builds the model on the device, fuses it with `trifuse.fuse` when this trifuse has it (else
runs it as is, and says so), runs one training step (forward + backward, under autocast for
bf16/fp16) so that every trifuse kernel and op dialect on the path tunes and writes the cache,
then replays the shapes that reached each dialect's torch.nn modules (nn.LayerNorm for
layer_norm, ...) through the dialect, forward and backward, so unfused models tune too. The
table of winners is printed; --export-defaults writes this GPU's cache as shipped defaults
(autotune/defaults/<family>.json).
"""
import argparse
import contextlib
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

from . import cache, dialects
from .decisions import format_table, records

# Published sizes of common checkpoints, as transformers config overrides of the model type.
PRESETS: dict[str, tuple[str, dict]] = {
    "gpt2-medium": ("gpt2", {"n_layer": 24, "n_embd": 1024, "n_head": 16}),
    "gpt2-large": ("gpt2", {"n_layer": 36, "n_embd": 1280, "n_head": 20}),
    "gpt2-xl": ("gpt2", {"n_layer": 48, "n_embd": 1600, "n_head": 25}),
    "bert-base": ("bert", {}),
    "bert-large": ("bert", {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
                            "intermediate_size": 4096}),
    "llama-3.2-1b": ("llama", {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
                               "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
                               "tie_word_embeddings": True}),
}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trifuse.autotune", description=__doc__.split("\n\n")[0])
    p.add_argument("model", metavar="MODEL_SPEC", help="model type, preset, config file or file.py:factory")
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="autocast dtype of the step (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--export-defaults", type=Path, default=None, metavar="PATH",
                   help="write this GPU's tuning cache as a shipped-defaults file (a folder: its "
                        "<family>.json, e.g. autotune/defaults/h200.json)")
    args = p.parse_args(argv)
    if args.batch < 1 or args.seq < 1:
        p.error(f"--batch and --seq must be positive, got {args.batch} and {args.seq}")
    return args


# ---------------------------------------------------------------------------------------------
# Building the model and its inputs
# ---------------------------------------------------------------------------------------------


def _overrides(text: str) -> dict:
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"trifuse.autotune: override {item!r} is not name=value")
        for parse in (int, float):
            try:
                out[name] = parse(value)
                break
            except ValueError:
                continue
        else:
            out[name] = {"true": True, "false": False}.get(value.lower(), value)
    return out


def build(spec: str, batch: int, seq: int, device: str) -> tuple[torch.nn.Module, tuple, dict, str]:
    """(model, positional inputs, keyword inputs, description) for a MODEL_SPEC."""
    path, sep, factory = spec.rpartition(":")
    if sep and path.endswith(".py"):
        return _from_factory(Path(path), factory, batch, seq, device)
    return _from_transformers(spec, batch, seq, device)


def _from_factory(path: Path, name: str, batch: int, seq: int, device: str):
    if not path.exists():
        raise SystemExit(f"trifuse.autotune: {path} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"_trifuse_autotune_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise SystemExit(f"trifuse.autotune: {path} has no callable {name!r}")
    params = inspect.signature(factory).parameters
    kwargs = {k: v for k, v in (("batch", batch), ("seq", seq)) if k in params}
    made = factory(**kwargs)
    model, inputs = made if isinstance(made, tuple) else (made, None)
    model = model.to(device)
    if inputs is None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is None:
            raise SystemExit(f"trifuse.autotune: {path}:{name} returned a model without inputs, and it "
                             "takes no input_ids (no config.vocab_size): return (model, inputs)")
        ids = torch.randint(0, vocab, (batch, seq), device=device)
        return model, (), {"input_ids": ids}, f"{path}:{name}"
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    return model, inputs, {}, f"{path}:{name}"


def _from_transformers(spec: str, batch: int, seq: int, device: str):
    import transformers

    name, _, extra = spec.partition(":")
    overrides = {}
    if name in PRESETS:
        name, overrides = PRESETS[name][0], dict(PRESETS[name][1])
    overrides.update(_overrides(extra))
    if Path(name).exists():
        config = transformers.AutoConfig.from_pretrained(name, **overrides)
    else:
        try:
            config = transformers.AutoConfig.for_model(name, **overrides)
        except ValueError as e:
            raise SystemExit(f"trifuse.autotune: {spec!r} is not a transformers model type, preset "
                             f"({', '.join(PRESETS)}), config path or file.py:factory ({e})") from None
    if hasattr(config, "use_cache"):
        config.use_cache = False  # training: no KV cache (DESIGN.md, the GPT-2 recompile trap)
    autos = (transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM, transformers.AutoModel)
    for auto in autos:
        try:
            model = auto.from_config(config)
            break
        except ValueError:
            continue
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and seq > positions:
        raise SystemExit(f"trifuse.autotune: --seq {seq} exceeds the model's {positions} positions")
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    kwargs = {"input_ids": ids}
    if "labels" in inspect.signature(model.forward).parameters:
        kwargs["labels"] = ids
    return model.to(device), (), kwargs, f"{type(model).__name__} ({config.model_type})"


def _loss(out) -> torch.Tensor:
    """The step's scalar: the model's loss if it returns one, else the sum of its float outputs."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else [out]
    total = [v.float().sum() for v in values if isinstance(v, torch.Tensor) and v.is_floating_point()]
    if not total:
        raise SystemExit("trifuse.autotune: the model returned no float tensor to differentiate")
    return torch.stack(total).sum()


# ---------------------------------------------------------------------------------------------
# Shapes reaching the dialects' modules, and their replay
# ---------------------------------------------------------------------------------------------


def _describe(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), a.dtype, a.device, a.requires_grad)
    return ("value", a)


def _rebuild(spec):
    if spec[0] == "value":
        return spec[1]
    _, shape, dtype, device, requires_grad = spec
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.randn(shape, dtype=dtype, device=device).requires_grad_(requires_grad)


@contextlib.contextmanager
def capture_shapes(model: torch.nn.Module, found: dict):
    """Forward hooks on every module some dialect captures; fills found[(op, arg specs)].

    The specs (shapes, dtypes, devices), not the dialect keys: a fused model calls its modules
    only while `fuse` captures it, on fake tensors, which no dialect keys (they are traced).
    """
    handles = []
    for module in model.modules():
        for dialect in dialects.all_dialects():
            for module_type, to_args in dialect.captures:
                if isinstance(module, module_type):
                    def hook(mod, inputs, output, dialect=dialect, to_args=to_args):
                        specs = tuple(_describe(a) for a in to_args(mod, *inputs))
                        if any(not isinstance(d, int) for s in specs if s[0] == "tensor" for d in s[1]):
                            return  # symbolic shapes (a dynamic capture): no concrete size to tune
                        found.setdefault((dialect.name, specs), (dialect, specs))
                    handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def replay(found: dict) -> None:
    """Calls each dialect once per distinct key on fresh tensors of the recorded shapes,
    forward and backward, so its choice is made (and cached) for those shapes."""
    seen = set()
    for dialect, specs in found.values():
        args = tuple(_rebuild(s) for s in specs)
        key = dialect.key(*args)
        if key is None or (dialect.name, key) in seen:
            continue
        seen.add((dialect.name, key))
        with torch.enable_grad():
            out = dialect(*args)
        outs = [o for o in (out if isinstance(out, tuple) else (out,))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # The one import of the rest of trifuse in autotune/: the ops register their dialects on import.
    import trifuse

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = DTYPES[args.dtype or ("bf16" if device.startswith("cuda") else "fp32")]
    model, inputs, kwargs, what = build(args.model, args.batch, args.seq, device)
    model.train()
    print(f"trifuse.autotune: {what}, batch {args.batch}, seq {args.seq}, {dtype} on {device}; "
          f"cache {cache.disk_cache(_device_index(device)).path}")
    fuse = getattr(trifuse, "fuse", None)
    if fuse is not None:
        model = fuse(model)
    else:
        print("trifuse.autotune: this trifuse has no trifuse.fuse: running the model as is; "
              "ops are tuned through the shapes reaching their torch.nn modules")
    found: dict = {}
    autocast = torch.autocast(torch.device(device).type, dtype=dtype, enabled=dtype != torch.float32)
    with capture_shapes(model, found):
        with autocast:
            loss = _loss(model(*inputs, **kwargs))
        loss.backward()
    replay(found)
    decided = records()
    if decided:
        print(format_table(decided))
    else:
        print("trifuse.autotune: no trifuse kernel or op dialect ran for this model: nothing to tune")
    if args.export_defaults is not None:
        _export(args.export_defaults, _device_index(device))
    return 0


def _device_index(device: str) -> int:
    d = torch.device(device)
    if d.type != "cuda":
        return -1
    return d.index if d.index is not None else torch.cuda.current_device()


def _export(path: Path, device_index: int) -> None:
    disk = cache.disk_cache(device_index)
    family = cache.gpu_family(disk.env.device)
    if family is None:
        raise SystemExit(f"trifuse.autotune: no GPU family for {disk.env.device!r}: nothing to export")
    if path.is_dir():  # a folder (autotune/defaults/): the file of this GPU's family in it
        path = path / f"{family}.json"
    env = disk.env
    entries = {**cache.read_defaults(path, family), **disk.entries()}
    cache.write_defaults(path, family, entries,
                         f"{env.device}, Triton {env.triton}, torch {env.torch} (python -m trifuse.autotune)")
    print(f"trifuse.autotune: wrote {len(entries)} entries to {path} ({family})")


if __name__ == "__main__":
    sys.exit(main())
