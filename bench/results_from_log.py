"""Rebuilds an op's results (JSON, markdown table) from the `row {json}` lines of a benchmark's log.

A lent GPU's call has a time limit, and a benchmark cut by it never writes its tables; every row it
measured is in its log, one JSON line each (`_harness._print_row`). This writes them as the
benchmark would have, with the speed-ups between providers recomputed per point, and the
environment (device, versions, measured copy bandwidth) taken from a results JSON of the same run:

    python bench/results_from_log.py LOG OP --env-from RESULTS.json [--out-dir DIR] [--note TEXT]

The table says the run was cut, and how many rows it has.
"""
import argparse
import importlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _harness as H  # noqa: E402


def rows_from_log(text: str) -> list[dict]:
    """The measured rows of a benchmark log, in order."""
    return [json.loads(line[4:]) for line in text.splitlines() if line.startswith("row {")]


def add_speedups(rows: list[dict]) -> list[dict]:
    """`x vs <provider>` for every pair of providers timed at the same point (variant, shape,
    mode), as `_harness.sweep` computes them; earlier ratios are dropped and recomputed."""
    points: dict[tuple, list[dict]] = {}
    for row in rows:
        for key in [k for k in row if k.startswith("x vs ")]:
            del row[key]
        if "ms" in row:
            points.setdefault((row.get("variant", ""), row["shape"], row["mode"]), []).append(row)
    for point in points.values():
        for row in point:
            for other in point:
                if other is not row:
                    row[f"x vs {other['provider']}"] = other["ms"] / row["ms"]
    return rows


def columns_for(op: str, rows: list[dict]) -> list[str]:
    """The benchmark's own columns when its module says them, else every key in first-seen order."""
    try:
        return list(importlib.import_module(f"bench_{op}").COLUMNS)
    except (ImportError, AttributeError):
        seen: dict[str, None] = {}
        for row in rows:
            seen.update(dict.fromkeys(row))
        return list(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("op")
    ap.add_argument("--env-from", type=Path, required=True, help="a results JSON written by the same run")
    ap.add_argument("--out-dir", type=Path, default=H.RESULTS_DIR)
    ap.add_argument("--suffix", default="")
    args = ap.parse_args()
    rows = add_speedups(rows_from_log(args.log.read_text()))
    if not rows:
        sys.exit(f"no `row` lines in {args.log}")
    env = json.loads(args.env_from.read_text())["environment"]
    env["note"] = f"cut by its time limit: {len(rows)} rows rebuilt from {args.log.name}"
    columns = columns_for(args.op, rows)
    path = H.write_results(args.op, rows, columns, out_dir=args.out_dir, suffix=args.suffix, env=env)
    print(f"{len(rows)} rows -> {path}")


if __name__ == "__main__":
    main()
