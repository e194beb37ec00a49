"""`trifuse.report(model)`: what `fuse` installed, what each capture replaced, where, and what it
left and why.

Counts (`counts()`, `by_pattern()`) are those of the captures each module ran in its most recent
forward: after a training step they are the training graph's, after an eval pass the eval
graph's. For a model compiled with the torch.compile backends they are the graphs its latest
forward ran, each counted as many times as it ran (a graph break inside every block compiles
one graph that every block runs). Everything is derived from the units found on the model's
modules, so a deep copy of a fused model reports on itself.
"""
import types
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .capture import Capture, Unit, installed_unit
from .fuse import _RECORDS, Note


@dataclass
class UnitReport:
    unit: Unit
    paths: list[str]  # this model's modules running the unit
    modules: list[torch.nn.Module]

    @property
    def name(self) -> str:
        return f"{_span(self.paths)} ({self.unit.cls.__name__}, {self.unit.strategy})"


@dataclass
class FusionReport:
    """What `trifuse.fuse` did to one model."""

    units: list[UnitReport] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)
    families: tuple[str, ...] | None = None
    fused: bool = False
    compiled: list[Capture] = field(default_factory=list)  # graphs rewritten by the torch.compile backends
    # (capture, runs) of the compiled graphs that ran in the model's latest forward
    compiled_runs: list[tuple[Capture, int]] = field(default_factory=list)

    def _last(self) -> list[tuple[str, Capture]]:
        out = [("(compiled)", c) for c, runs in self.compiled_runs for _ in range(runs)]
        for u in self.units:
            for path, module in zip(u.paths, u.modules):
                capture = u.unit.last.get(module)
                if capture is not None:
                    out.append((path, capture))
        return out

    def counts(self) -> dict[str, int]:
        """Replacements per family (attention, layer_norm, ...) in the latest forward."""
        c: Counter[str] = Counter()
        for _, capture in self._last():
            c.update(capture.log.counts)
        return dict(c)

    def by_pattern(self) -> dict[str, int]:
        """Replacements per pattern name in the latest forward."""
        c: Counter[str] = Counter()
        for _, capture in self._last():
            c.update(capture.log.by_pattern)
        return dict(c)

    def replaced(self) -> list[tuple[str, str, str, str]]:
        """(module path, where inside it, pattern, family) for each replacement of the latest forward."""
        return [(path, r.where, r.pattern, r.family) for path, capture in self._last() for r in capture.log.active]

    def rejected(self) -> list[tuple[str, str, str, str]]:
        """(module path, where inside it, pattern, reason) for each candidate left in a graph."""
        return [(path, r.where, r.pattern, r.reason) for path, capture in self._last() for r in capture.log.rejected]

    def left(self) -> list[tuple[str, str, str, str]]:
        """(module path, where inside it, op, reason) for each op a pattern looks for (softmax,
        gelu, dropout, ...) that stayed as the model wrote it in the latest forward."""
        return [(path, r.where, r.op, r.reason) for path, capture in self._last() for r in capture.log.left]

    def unfused_calls(self) -> dict[str, dict[str, int]]:
        """Per unit, the calls that ran the original forward, by reason ('fell back to eager' for
        Dynamo fallbacks)."""
        out: dict[str, dict[str, int]] = {}
        for u in self.units:
            calls = dict(u.unit.eager_calls)
            if getattr(u.unit, "fallbacks", 0):
                calls["Dynamo ran no captured graph (fell back to eager: recompile limit or skipped frame)"] = \
                    u.unit.fallbacks
            if calls:
                out[u.name] = calls
        return out

    def table(self) -> str:
        lines = []
        if self.compiled:
            lines.append(f"torch.compile backends: {len(self.compiled)} graph(s) rewritten, "
                         f"{len(self.compiled_runs)} ran in the latest forward")
            for capture, runs in self.compiled_runs:
                lines.append(_compiled_table(capture, runs))
        if not self.fused:
            if self.compiled:
                return "\n".join(lines + [_counts_line(self.counts())])
            return "trifuse: this model was not fused (call trifuse.fuse(model) or torch.compile it with backend='trifuse')"
        fams = "all families" if self.families is None else ", ".join(self.families)
        lines.append(f"trifuse.fuse ({fams}): {len(self.units)} unit(s)")
        for u in self.units:
            lines.append(f"  {u.name}: {u.unit.calls} call(s), {len(u.unit.captures)} capture(s)")
            if getattr(u.unit, "graphs", None) is not None:
                lines.append(f"    {u.unit.graphs.summary()}")
            for reason, n in getattr(u.unit, "dynamo_calls", {}).items():
                lines.append(f"    captured by Dynamo instead: {n} call(s): {reason}")
            if u.unit.outside_traces:
                lines.append("    traced by a torch.compile or torch.export of the model, which sees its "
                             "code as the model wrote it: fused there only by backend='trifuse' or "
                             "'trifuse_inductor'")
            inner = getattr(u.unit, "inner_checkpoints", None)
            if inner:
                lines.append(f"    checkpointed layers inside it run in its checkpoint, without one of their own (the "
                             f"block's recomputes them): {', '.join(inner)}")
        for n in self.notes:
            lines.append(f"  {n.kind}: {n.path} ({n.cls}): {n.reason}")
        for u in self.units:
            groups: dict[tuple, list[Capture]] = {}
            used = [c for m in u.modules if (c := u.unit.last.get(m)) is not None]
            for capture in dict.fromkeys([*u.unit.captures, *used]):
                groups.setdefault(_signature(capture), []).append(capture)
            for captures in groups.values():
                lines.append(capture_table(u.unit, captures[-1], self._paths_of(u, captures), len(captures)))
        skipped: dict[str, set[str]] = {}
        for u in self.units:
            for capture in u.unit.captures:
                for pattern, reason in capture.log.skipped.items():
                    skipped.setdefault(reason, set()).add(pattern)
        for reason, patterns in skipped.items():
            lines.append(f"  skipped patterns ({reason}): {', '.join(sorted(patterns))}")
        for name, calls in self.unfused_calls().items():
            for reason, n in calls.items():
                lines.append(f"  unfused: {name}: {n} call(s): {reason}")
        lines.append(_counts_line(self.counts(), any(u.unit.outside_traces for u in self.units)))
        decisions = self.decisions()
        if decisions:
            from ..autotune import format_table

            lines.append("implementations chosen in this process (op dialects and kernel configs, per shape):")
            lines += ["    " + line for line in format_table(decisions).splitlines()]
        return "\n".join(lines)

    @staticmethod
    def decisions() -> tuple:
        """Which implementation each op dialect chose (trifuse's kernel, PyTorch's, ...) and which
        launch configuration each tuned kernel uses, per shape bucket, with how it was decided
        and why the other candidates were rejected: every decision made in this process so far
        (they are per shape, not per model; the fused model's calls make them)."""
        from ..autotune import records

        return records()

    def _paths_of(self, u: UnitReport, captures: list[Capture]) -> str:
        paths = [p for p, m in zip(u.paths, u.modules) if any(u.unit.last.get(m) is c for c in captures)]
        return _span(paths) if paths else _span(u.paths)

    def __str__(self) -> str:
        return self.table()


def _counts_line(counts: dict[str, int], traced_outside: bool = False) -> str:
    if not counts:
        if traced_outside:  # a compiled model's calls never reach the units
            return ("latest forward: no replacements ran (not called yet, nothing matched, or the model ran "
                    "as compiled by torch.compile: see 'traced' above)")
        return "latest forward: no replacements ran (not called yet, or nothing matched)"
    return "latest forward, per family: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _compiled_table(capture: Capture, runs: int) -> str:
    lines = [f"  [{capture.mode}]: ran {runs} time(s) in the latest forward"]
    if capture.error:
        lines.append(f"    rewrite failed, compiled unfused: {capture.error}")
    rows = [("replaced", r.family, r.pattern, r.where + (f" ({r.note})" if r.note else ""))
            for r in capture.log.active]
    rows += [("rejected", r.family, r.pattern, f"{r.where}: {r.reason}") for r in capture.log.rejected]
    rows += [("dialect", "", "", text) for text in capture.log.dialects if "no dialect choice" in text]
    if rows:
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines += [f"    {a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def _signature(c: Capture) -> tuple:
    return (c.mode, c.error, tuple(c.graph_breaks), tuple((r.pattern, r.where) for r in c.log.active),
            tuple((r.pattern, r.where, r.reason) for r in c.log.rejected), tuple((r.op, r.where) for r in c.log.left))


def capture_table(unit: Unit, capture: Capture, paths: str | None = None, count: int = 1) -> str:
    """One capture as a table: replaced, rejected, left (`count` identical captures: new shapes)."""
    head = f"{paths or _span(unit.paths)} ({unit.cls.__name__}, {unit.strategy}) [{capture.mode}]"
    again = f", captured {count} times (new shapes)" if count > 1 else ""
    lines = [f"  {head}: {capture.graphs} graph(s){again}"]
    if capture.error:
        lines.append(f"    rewrite failed, running unfused: {capture.error}")
    rows = [("replaced", r.family, r.pattern, r.where + (f" ({r.note})" if r.note else ""))
            for r in capture.log.active]
    rows += [("rejected", r.family, r.pattern, f"{r.where} [{r.node}]: {r.reason}") for r in capture.log.rejected]
    rows += [("left", "", r.op, f"{r.where} [{r.node}]: {r.reason}") for r in capture.log.left]
    rows += [("cast once", "", "", text) for text in capture.log.shared_casts]
    rows += [("fp32 weight grad", "", "", text) for text in capture.log.fp32_weight_grads]
    rows += [("graph break", "", "", f"{text} (what runs between its graphs runs as written)")
             for text in capture.graph_breaks]
    if rows:
        w = [max(len(r[i]) for r in rows) for i in range(3)]
        lines += [f"    {a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {d}" for a, b, c, d in rows]
    return "\n".join(lines)


def report(model: torch.nn.Module | Callable[..., Any]) -> FusionReport:
    """What `trifuse.fuse(model)` replaced, per pattern and family, where, and every candidate
    it rejected and why; for a model compiled with backend="trifuse" or "trifuse_inductor", what
    the backend replaced in its graphs, and the same for a function so compiled (`report(fn)` or
    `report(torch.compile(fn, ...))`). `print(report(model))` shows it as a table."""
    from .backend import compiled_captures, latest_forward

    model = getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule
    if not isinstance(model, torch.nn.Module):
        fn = getattr(model, "_torchdynamo_orig_callable", model)  # torch.compile(fn)'s wrapper
        if not isinstance(fn, types.FunctionType):
            raise TypeError("trifuse.report: model must be a torch.nn.Module or a function (compiled "
                            f"with a trifuse backend), got {type(model).__name__}")
        compiled = compiled_captures(fn)
        return FusionReport([], [], None, compiled=compiled, compiled_runs=latest_forward(compiled, {}))
    units: dict[int, UnitReport] = {}
    for path, module in model.named_modules():
        unit = installed_unit(module)
        if unit is None:
            continue
        entry = units.setdefault(id(unit), UnitReport(unit, [], []))
        entry.paths.append(path or "(model)")
        entry.modules.append(module)
    record = _RECORDS.get(model)
    compiled = compiled_captures(model)
    return FusionReport(
        list(units.values()),
        list(record.notes) if record else [],
        record.families if record else None,
        fused=record is not None or bool(units),
        compiled=compiled,
        compiled_runs=latest_forward(compiled, {id(p): p for p in model.parameters()}),
    )


def _span(paths: list[str]) -> str:
    """'h.0', 'h.1', 'h.2' -> 'h.0-2'."""
    if len(paths) <= 1:
        return "".join(paths)
    heads = {p.rsplit(".", 1)[0] for p in paths}
    tails = [p.rsplit(".", 1)[-1] for p in paths]
    if len(heads) == 1 and all(t.isdigit() for t in tails):
        return f"{heads.pop()}.{tails[0]}-{tails[-1]}"
    return ", ".join(paths)
