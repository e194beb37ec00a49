"""Launch plans for the row-wise elementwise kernels (bias + GeLU, dropout + add, gated activations).

Those kernels see their input as M rows of N contiguous features (any row stride) and work on
2-D tiles of BLOCK_M rows x BLOCK_N columns, a few thousand elements per program, 16 per thread:
each thread moves 16-byte vectors and has several in flight, whatever the width. A 1-D grid
enumerates (row group, column tile) pairs, so no grid axis meets CUDA's 65535 limit.

Forward passes take one tile per program. Backward passes that also reduce over rows (dbias)
run a fixed number of programs, each walking a contiguous range of row tiles of one column tile
and writing one fp32 partial row; the partial rows are summed afterwards in a fixed order
(deterministic, no atomics).

The tile size, warps, programs per SM and the backward's prefetch are a tuner's choice per shape
bucket (autotune/configs.py: rowwise_fwd, rowwise_bwd; entry 0 of each space is the plan below
with its default arguments, what the kernels ran before they were tuned). `RowwiseTuning` keeps
each kernel's launch per exact call shape: once its bucket is decided, a launcher pays a
dictionary lookup, not this arithmetic.
"""
import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton

from ..autotune import Tuner, configs, pow2_bucket
from ._common import next_power_of_2
from ._launch import store_plan

# One tile per program: 8 warps, 16 elements a thread (two 16-byte vectors of bf16 per tensor).
# Fewer starve H100's memory system of requests in flight; more add registers, not bandwidth.
TILE_ELEMENTS = 4096
MAX_BLOCK_N = 1024
# Reducing backward passes: 4 warps a program, PROGRAMS_PER_SM programs per SM, so that all of
# them are resident at once (one wave, no tail) at up to 128 registers a thread while 16 warps
# per SM keep loads in flight. Column tiles of at most 256 keep the fp32 partial rows
# (programs x BLOCK_N x 4 bytes, about 0.5 MiB on H100) near 1% of a target-size step's traffic;
# 256 bf16 columns are still 512 contiguous bytes, one warp's vector load.
REDUCE_TILE_ELEMENTS = 2048
REDUCE_MAX_BLOCK_N = 256
PROGRAMS_PER_SM = 4
MIN_BLOCK_N = 128


class Plan(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    col_tiles: int
    groups: int  # programs = groups * col_tiles
    rows_per_group: int  # a multiple of block_m

    @property
    def programs(self) -> int:
        return self.groups * self.col_tiles


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python (Triton 3.9's `triton.cdiv` costs about 2 us a host call)."""
    return -(-a // b)


def _tile(m: int, n: int, tile_elements: int, max_block_n: int, max_warps: int) -> tuple[int, int, int]:
    """BLOCK_N is the widest power of two up to max_block_n whose padding of n is within 2% of
    the least padding any candidate gives (n = 768 takes 256, not 1024 with a quarter masked
    off); BLOCK_M fills the tile up to tile_elements without passing the number of rows; warps
    as many as keep the full tile's elements a thread (tile_elements / 32 / max_warps), at most
    max_warps."""
    top = min(max_block_n, next_power_of_2(n))
    candidates = []
    b = top
    while b >= min(MIN_BLOCK_N, top):
        candidates.append(b)
        b //= 2
    least = min(cdiv(n, b) * b for b in candidates)
    block_n = next(b for b in candidates if cdiv(n, b) * b <= least * 1.02)
    block_m = min(max(tile_elements // block_n, 1), next_power_of_2(m))
    per_thread = max(tile_elements // (32 * max_warps), 1)
    num_warps = min(max(block_m * block_n // (32 * per_thread), 1), max_warps)
    return block_m, block_n, num_warps


@functools.lru_cache(maxsize=1024)
def elementwise_plan(m: int, n: int, tile: int = TILE_ELEMENTS, warps: int = 8) -> Plan:
    """One tile of about `tile` elements per program over an (m, n) pass, `warps` warps."""
    block_m, block_n, num_warps = _tile(m, n, tile, MAX_BLOCK_N, warps)
    return Plan(block_m, block_n, num_warps, cdiv(n, block_n), cdiv(m, block_m), block_m)


@functools.lru_cache(maxsize=1024)
def reduce_plan(m: int, n: int, sms: int, reduce: bool, tile: int = REDUCE_TILE_ELEMENTS, warps: int = 4,
                programs_per_sm: int = PROGRAMS_PER_SM) -> Plan:
    """A backward pass over (m, n) that, when `reduce`, also sums over rows: about
    programs_per_sm * sms programs, each owning rows_per_group rows of one column tile.
    Without the reduction every program takes one tile."""
    block_m, block_n, num_warps = _tile(m, n, tile, REDUCE_MAX_BLOCK_N, warps)
    col_tiles, row_tiles = cdiv(n, block_n), max(cdiv(m, block_m), 1)
    if not reduce:
        return Plan(block_m, block_n, num_warps, col_tiles, row_tiles, block_m)
    groups = min(max(programs_per_sm * sms // col_tiles, 1), row_tiles)  # floor: never past one wave
    tiles_per_group = cdiv(row_tiles, groups)
    return Plan(block_m, block_n, num_warps, col_tiles, cdiv(row_tiles, tiles_per_group),
                tiles_per_group * block_m)


def plan_of(cfg: triton.Config, m: int, n: int, sms: int = 0, reduce: bool = False) -> Plan:
    """The plan of a config from autotune/configs.py's row-wise spaces: a backward space's
    (PROGRAMS_PER_SM among its keywords) by reduce_plan, a forward one's by elementwise_plan."""
    kw = cfg.kwargs
    if "PROGRAMS_PER_SM" in kw:
        return reduce_plan(m, n, sms, reduce, kw["TILE"], cfg.num_warps, kw["PROGRAMS_PER_SM"])
    return elementwise_plan(m, n, kw["TILE"], cfg.num_warps)


class RowwiseLaunch(NamedTuple):
    """A row-wise kernel's launch for one exact call shape: grid, keywords, and the plan."""
    grid: tuple[int]
    meta: dict
    plan: Plan


def rowwise_launch(cfg: triton.Config, m: int, n: int, sms: int, reduce: bool,
                   constexprs: dict) -> RowwiseLaunch:
    """The launch of `cfg` at (m, n): the plan's grid and block sizes, the config's PREFETCH where
    it has one, and the kernel's own constexprs."""
    plan = plan_of(cfg, m, n, sms, reduce)
    meta = {**constexprs, "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "num_warps": plan.num_warps}
    if "PREFETCH" in cfg.kwargs:
        meta["PREFETCH"] = cfg.kwargs["PREFETCH"]
    return RowwiseLaunch((plan.programs,), meta, plan)


class RowwiseTuning:
    """One row-wise kernel's tuner and launches (as kernels/layer_norm.py keeps the norms'):
    `launch(...)` is a dict lookup per exact call shape once the tuner has decided its bucket.

    The tuning key is (device, dtype, n, rows bucket, *variant); `variant_names` name the kernel's
    own flags (bias, form, ...). A summing backward's config sets how the rows are split into
    partial sums, so under torch.use_deterministic_algorithms it takes its space's default, the
    same in every process. `summing`: the kernel is a summing backward (its programs walk rows:
    rowwise_bwd's space), not a one-tile kernel (rowwise_fwd's; the gated backward is one)."""

    def __init__(self, name: str, variant_names: tuple[str, ...], summing: bool) -> None:
        space = configs.rowwise_bwd if summing else configs.rowwise_fwd
        prune = configs.prune_rowwise_bwd if summing else None
        self.tuner = Tuner(name, space, ("device", "dtype", "n", "rows", *variant_names), prune=prune)
        self.summing = summing
        self.launches: dict[tuple, RowwiseLaunch] = {}

    def launch(self, device: int, dtype: torch.dtype, m: int, n: int, sms: int, reduce: bool, variant: tuple,
               constexprs: dict, timed: Callable[..., object], *args) -> RowwiseLaunch:
        """The launch for this call. `timed(cfg, *args)` runs the kernel with `cfg`, for the tuner."""
        deterministic = reduce and torch.are_deterministic_algorithms_enabled()
        key = (device, dtype, m, n, sms, reduce, variant, deterministic)
        hit = self.launches.get(key)
        if hit is not None:
            return hit
        tuning_key = (device, dtype, n, pow2_bucket(m), *variant)
        if deterministic:
            cfg = configs.rowwise_bwd(True)[0]
        else:
            cfg = self.tuner.config(tuning_key, timed, *args)
        launch = rowwise_launch(cfg, m, n, sms, reduce, constexprs)
        if deterministic or self.tuner.is_decided(tuning_key):
            store_plan(self.launches, key, launch)
        return launch


# Launches shared by the row-wise kernels. A one-tile kernel takes its runtime arguments, then
# col_tiles; a summing backward kernel its arguments up to and including DX (`head`), its fp32
# partial rows of dbias (DX again, unused, without a bias), the rest (`tail`), then
# rows_per_program and col_tiles.


def run_one_tile(kernel: Callable, launch: RowwiseLaunch, args: tuple) -> None:
    """Launches a one-tile kernel (a CachedKernel) with `launch`."""
    kernel.run(launch.grid, (*args, launch.plan.col_tiles), launch.meta)


def time_one_tile(cfg: triton.Config, kernel: Callable, m: int, n: int, constexprs: dict,
                  args: tuple) -> None:
    """One launch of a one-tile kernel with `cfg` (what its tuner times; it rewrites the outputs)."""
    run_one_tile(kernel, rowwise_launch(cfg, m, n, 0, False, constexprs), args)


def run_summing(kernel: Callable, launch: RowwiseLaunch, head: tuple, tail: tuple, n: int, acc: torch.dtype,
                has_bias: bool, device: torch.device) -> torch.Tensor | None:
    """Launches a summing backward kernel with `launch`; returns its partial rows of dbias
    (launch.plan.groups x n in `acc`), None without a bias."""
    plan = launch.plan
    partial = torch.empty((plan.groups, n), dtype=acc, device=device) if has_bias else None
    kernel.run(launch.grid, (*head, head[-1] if partial is None else partial, *tail, plan.rows_per_group,
                             plan.col_tiles), launch.meta)
    return partial


def time_summing(cfg: triton.Config, kernel: Callable, m: int, n: int, sms: int, constexprs: dict,
                 head: tuple, tail: tuple, acc: torch.dtype, has_bias: bool, device: torch.device) -> None:
    """One launch of a summing backward kernel with `cfg` (what its tuner times), with partial
    rows of its own, sized by its plan."""
    launch = rowwise_launch(cfg, m, n, sms, has_bias, constexprs)
    run_summing(kernel, launch, head, tail, n, acc, has_bias, device)
