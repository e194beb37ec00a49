"""What was chosen where, and why: one `Decision` per (kernel or op, device, shape bucket).

Kernel tuners and operator dialects both record here; `trifuse.report`, the autotune command
line and tests read `records()`. Only the latest decision per bucket is kept (a process makes a
handful: one per distinct shape bucket), so this is a cache, not a log.
"""
import contextlib
import contextvars
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

log = logging.getLogger("trifuse")

# (label, zero-argument step) -> milliseconds. The defaults time a CUDA step with
# triton.testing.do_bench (kernel configs) or by wall time per call (dialects); tests pass a fake
# one so tuning logic is deterministic on CPU.
Timer = Callable[[str, Callable[[], object]], float]


@dataclasses.dataclass(frozen=True)
class Decision:
    """One choice. `kind` is "kernel" (a launch configuration) or "dialect" (an implementation).

    source says how it was reached: "measured" (a dialect's followed by the candidates it did
    not tune: "measured; not tuned, ..."), "disk cache", "shipped <family> defaults",
    "default (...)" with the reason no timing happened, or "fallback (...)".
    times_ms holds what was timed (empty unless measured or replayed from the disk cache);
    rejected maps each candidate not taken to why, when it could not take the call at all.
    seconds: the wall time the decision took (compiles, checks and timing; a dialect's includes
    the tuning of its candidates' kernels): what a first step spends choosing. phases: where
    those seconds went, by part (a dialect's "reference", "check <candidate>" and "time
    <candidate>", the first call of a candidate compiling its kernels inside its check; a
    kernel's "compile" and "time"); what no phase covers is bookkeeping.
    """

    kind: str
    name: str
    device: str
    bucket: str
    chosen: str
    source: str
    times_ms: Mapping[str, float] = dataclasses.field(default_factory=dict)
    rejected: Mapping[str, str] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0
    nested: bool = False  # made while another decision was being made (a dialect's trial)
    phases: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __str__(self) -> str:
        text = f"{self.name} [{self.bucket}] on {self.device}: {self.chosen} ({self.source}"
        text += f", {self.seconds:.2f} s)" if self.seconds >= 0.01 else ")"
        if self.times_ms:
            fastest_first = sorted(self.times_ms.items(), key=lambda kv: kv[1])
            text += "; " + ", ".join(f"{k} {v:.4g} ms" for k, v in fastest_first)
        for name, reason in self.rejected.items():
            text += f"; {name} rejected: {reason}"
        return text


_RECORDS: dict[tuple[str, str, str, str], Decision] = {}
_DEPTH: contextvars.ContextVar[int] = contextvars.ContextVar("trifuse_deciding", default=0)


class Clock:
    """The wall time of one decision so far, whether another decision encloses it, and the
    seconds of its phases (`phase`)."""

    def __init__(self, nested: bool) -> None:
        self.start = time.perf_counter()
        self.nested = nested
        self.phases: dict[str, float] = {}

    def seconds(self) -> float:
        return time.perf_counter() - self.start


_CLOCK: contextvars.ContextVar[Clock | None] = contextvars.ContextVar("trifuse_decision_clock", default=None)


@contextlib.contextmanager
def backward_here():
    """The backward passes started inside run on this thread. On CUDA autograd runs them on a
    device thread of its own, where this thread's contextvars are not set (torch 2.11): a
    decision's state (its clock, a screening's `untuned`, a compile pass's flag) and Triton's
    AsyncCompileMode. On the lent H200 (2026-12-04) a compile pass's backward kernels therefore
    compiled one after another there, and their tuners timed every config (~10 s of GPT-2
    medium's first step), counted apart from the decision they were part of."""
    with torch.autograd.set_multithreading_enabled(False):  # (thread-local)
        yield


@contextlib.contextmanager
def deciding():
    """Around one decision (a tuner's or a dialect's): yields its Clock. The backward passes of
    the calls it makes run on this thread (`backward_here`), inside the decision."""
    depth = _DEPTH.get()
    clock = Clock(depth > 0)
    token, clock_token = _DEPTH.set(depth + 1), _CLOCK.set(clock)
    try:
        with backward_here():
            yield clock
    finally:
        _CLOCK.reset(clock_token)
        _DEPTH.reset(token)


@contextlib.contextmanager
def phase(name: str):
    """Adds the wall time inside to phase `name` of the decision being made (the innermost);
    nothing outside a decision."""
    clock = _CLOCK.get()
    start = time.perf_counter()
    try:
        yield
    finally:
        if clock is not None:
            clock.phases[name] = clock.phases.get(name, 0.0) + time.perf_counter() - start


def record(decision: Decision) -> None:
    _RECORDS[(decision.kind, decision.name, decision.device, decision.bucket)] = decision
    news = decision.source.startswith(("measured", "fallback"))
    level = logging.INFO if news else logging.DEBUG
    log.log(level, "trifuse %s: %s", decision.kind, decision)


def records(name: str | None = None, kind: str | None = None) -> tuple[Decision, ...]:
    """Every decision this process made, optionally of one kernel/op `name` or one `kind`."""
    return tuple(d for d in _RECORDS.values()
                 if (name is None or d.name == name) and (kind is None or d.kind == kind))


def lookup(kind: str, name: str, device: str, bucket: str) -> Decision | None:
    return _RECORDS.get((kind, name, device, bucket))


def clear_records() -> None:
    _RECORDS.clear()


def set_up_seconds(decisions: Iterable[Decision], top: int = 8) -> tuple[float, list[str]]:
    """(seconds spent deciding, the costliest decisions as text): where a first step's set-up
    went. A dialect's time includes the tuning of its candidates' kernels, so the total counts
    the decisions made outside any other."""
    decisions = [d for d in decisions if d.seconds > 0]
    total = sum(d.seconds for d in decisions if not d.nested)
    ranked = sorted(decisions, key=lambda d: -d.seconds)[:top]
    return total, [f"{d.seconds:.2f} s {d.kind} {d.name} [{d.bucket}] ({d.source})" + _phases_text(d)
                   for d in ranked]


def _phases_text(d: Decision) -> str:
    """'; phases: check trifuse 6.1 s, ...' by time, the phases under 0.01 s left out."""
    parts = [f"{name} {sec:.2f} s" for name, sec in sorted(d.phases.items(), key=lambda kv: -kv[1])
             if sec >= 0.01]
    return "; phases: " + ", ".join(parts) if parts else ""


# ---------------------------------------------------------------------------------------------
# Buckets: the part of a key that is about shapes, as text for the disk cache and the tables.
# ---------------------------------------------------------------------------------------------


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (0 stays 0): sizes within a factor of two share a result."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


def bucket_string(names: Sequence[str], values: Iterable[object], skip: str = "device") -> str:
    return ",".join(f"{n}={_text(v)}" for n, v in zip(names, values) if n != skip)


def _text(v: object) -> str:
    text = str(v)
    return text.removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def format_table(decisions: Sequence[Decision], max_rejected: int = 2) -> str:
    """A plain-text table of decisions: what won, how, against what. A kernel prunes a dozen
    configurations for one reason each; past `max_rejected` of them a row says how many more
    there are (`records()` keeps every reason)."""
    header = ("kind", "name", "bucket", "device", "chosen", "source", "timed (ms)", "rejected")
    rows = [header]
    for d in decisions:
        timed = ", ".join(f"{k} {v:.4g}" for k, v in sorted(d.times_ms.items(), key=lambda kv: kv[1]))
        reasons = [f"{k}: {v}" for k, v in d.rejected.items()]
        if len(reasons) > max_rejected:
            more = len(reasons) - max_rejected
            reasons = reasons[:max_rejected] + [f"+{more} more (trifuse.autotune.records())"]
        rows.append((d.kind, d.name, d.bucket, d.device, d.chosen, d.source, timed, "; ".join(reasons)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    # the last column is free text: its rule as wide as its title, not its longest cell
    lines.insert(1, "  ".join("-" * w for w in widths[:-1] + [len(header[-1])]))
    return "\n".join(lines)
