"""A persistent group of gloo worker processes that tests hand functions to.

Starting processes and a process group costs seconds on this machine, so one world of each
size serves every test (a session fixture in conftest.py). `World.run(fn, *args)` calls
`fn(rank, world_size, *args)` on every rank and returns the per-rank results; `fn` must be a
module-level function of a file under tests/ (it is found again in the workers by file path
and name, whatever pytest's import mode). A failure on any rank raises with that rank's
traceback; a world that timed out or failed is closed, and the fixture starts a fresh one
for the next test, so one broken test cannot leak a wedged process group into the next. A rank
that dies (a native crash: a signal, an abort) is reported at once with its exit status and the
Python stacks faulthandler wrote as it died, not after the parent's timeout; the call is then
run once more on fresh processes, with the death as a warning (a rank of these tests died twice
in 2026-11 of heap corruption inside PyTorch's CPU or gloo code, not reproduced, while trifuse's
kernels touched no memory outside their arguments: bench/results/README.md). A second death, a
failure or a timeout fails the test.
"""

import faulthandler
import importlib.util
import os
import pickle
import queue
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch.multiprocessing as mp

TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MODULES: dict = {}


def _load(path: str):
    if path not in _MODULES:
        spec = importlib.util.spec_from_file_location(f"_world_task_{len(_MODULES)}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _MODULES[path] = module
    return _MODULES[path]


def _serve(rank: int, size: int, port: int, paths: list[str], inbox, outbox, stacks: str) -> None:
    import torch
    import torch.distributed as dist

    crash_file = open(stacks + ".crash", "w")  # kept open: faulthandler writes to it as the rank dies
    faulthandler.enable(file=crash_file, all_threads=True)

    torch.set_num_threads(1)  # 2 cores shared by every worker and every other user of the machine
    sys.path[:0] = paths
    import _device  # noqa: F401  (as in conftest.py: the interpreter where no GPU is, patched for speed)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        with open(stacks, "w") as stack_file:
            while (task := inbox.get()) is not None:
                path, name, args, timeout = task
                # Where this rank is, written to `stacks` should the task outlive most of the
                # parent's wait: a hang's report then says which collective or lock it sits in.
                stack_file.seek(0)
                stack_file.truncate()
                faulthandler.dump_traceback_later(0.9 * timeout, file=stack_file)
                try:
                    # Pickled here, not in the queue's feeder thread, so that an unpicklable result
                    # is reported as a failure instead of being dropped silently.
                    outbox.put(
                        (rank, True, bytes(ForkingPickler.dumps(getattr(_load(path), name)(rank, size, *args))))
                    )
                except Exception:  # reported to the parent, which fails the test with it
                    outbox.put((rank, False, traceback.format_exc()))
                finally:
                    faulthandler.cancel_dump_traceback_later()
    finally:
        dist.destroy_process_group()


class RankDied(AssertionError):
    """A rank of the world died (a signal or an exit) while running a call."""


class World:
    def __init__(self, size: int):
        self.size = size
        self.broken = False
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        here = os.path.dirname(os.path.abspath(__file__))
        paths = [here, os.path.dirname(here)]
        port = free_port()
        size = self.size
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(size)]
        self._stacks_dir = tempfile.TemporaryDirectory(prefix="trifuse_world_")
        self.stacks = [os.path.join(self._stacks_dir.name, f"rank{r}.txt") for r in range(size)]
        self.procs = [
            ctx.Process(
                target=_serve, args=(r, size, port, paths, self.inboxes[r], self.outbox, self.stacks[r]), daemon=True
            )
            for r in range(size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, timeout: float = TIMEOUT_S) -> list:
        """fn(rank, size, *args) on every rank; the results in rank order. Run once more on fresh
        processes if a rank dies (see the module docstring)."""
        try:
            return self._run_once(fn, *args, timeout=timeout)
        except RankDied as first:
            warnings.warn(f"{first}\nrunning {fn.__name__} once more on fresh processes", RuntimeWarning,
                          stacklevel=2)
            self.close()
            self._start()
            try:
                result = self._run_once(fn, *args, timeout=timeout)
            except RankDied as second:
                raise RankDied(f"{second}\n... and on the first run:\n{first}") from None
            self.broken = False
            return result

    def _run_once(self, fn, *args, timeout: float) -> list:
        path = sys.modules[fn.__module__].__file__
        for q in self.inboxes:
            q.put((path, fn.__name__, args, timeout))
        results: dict[int, object] = {}
        failures: list[str] = []
        deadline = time.monotonic() + timeout
        try:
            while len(results) < self.size:
                try:
                    wait = min(1.0, max(deadline - time.monotonic(), 0.01))
                    rank, ok, value = self.outbox.get(timeout=wait)
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs)
                            if p.exitcode is not None and r not in results]
                    if dead:
                        self.broken = True
                        raise RankDied(f"world of {self.size}: rank(s) {dead} died in {fn.__name__}\n"
                                       + "\n".join(failures) + "\n" + self._deaths(dead)) from None
                    if time.monotonic() >= deadline:
                        raise
                    continue
                results[rank] = pickle.loads(value) if ok else value
                if not ok:
                    failures.append(f"rank {rank}:\n{value}")
        except queue.Empty as e:  # a rank hung (e.g. in a collective)
            self.broken = True
            done = ", ".join(f"rank {r} {'failed' if any(f.startswith(f'rank {r}:') for f in failures) else 'returned'}"
                             for r in sorted(results)) or "no rank returned"
            raise AssertionError(
                f"world of {self.size} timed out after {timeout} s in {fn.__name__} ({done})\n"
                + "\n".join(failures) + "\n" + self._stacks_of(set(range(self.size)) - set(results))
            ) from e
        if failures:
            self.broken = True
            raise AssertionError("\n".join(failures))
        return [results[r] for r in range(self.size)]

    def _deaths(self, ranks: list[int]) -> str:
        """Each dead rank's exit status and what faulthandler wrote as it died."""
        out = []
        for r in ranks:
            code = self.procs[r].exitcode
            how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            try:
                with open(self.stacks[r] + ".crash") as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            out.append(f"rank {r} died ({how}); its stacks:\n{text[-8000:] or '(none written)'}")
        return "\n".join(out)

    def _stacks_of(self, ranks: set[int]) -> str:
        """The stacks the ranks still running wrote when their task outlived most of the wait."""
        out = []
        for r in sorted(ranks):
            try:
                with open(self.stacks[r]) as f:
                    text = f.read().strip()
            except OSError:
                text = ""
            out.append(f"rank {r} stacks:\n{text[-6000:] or '(none written)'}")
        return "\n".join(out)

    def close(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10 if p.exitcode is None and not self.broken else 1)
            if p.is_alive():
                p.kill()
                p.join()
        self._stacks_dir.cleanup()

