"""Summarizes the per-instruction warp-stall samples of ``tools/ncu_kernels.sh`` (runs here).

    python tools/ncu_stalls.py DIR/fwd_sass.csv.gz [top instructions, default 40] [context]

Prints the kernel's samples per stall reason, then its most sampled SASS instructions with their
main reasons; with a third argument, each of those with the instructions just before it.
"""

from __future__ import annotations

import collections
import csv
import gzip
import sys


SAMPLES = "Warp Stall Sampling (All Samples)"  # the column of an instruction's samples


def read(path):
  with gzip.open(path, "rt") as fh:
    lines = fh.read().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
  return list(csv.DictReader(lines[start:]))


def _num(x):
  try:
    return float(x)
  except ValueError:
    return 0.0


def main(path, top="40", context=None):
  rows = read(path)
  reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
  total = sum(_num(r[SAMPLES]) for r in rows)
  per = collections.Counter()
  for r in rows:
    for c in reasons:
      per[c] += _num(r[c])
  print(f"{path}: {len(rows)} instructions, {total:.0f} samples")
  for c, n in per.most_common():
    if n:
      print(f"  {c[6:]:18s} {n:8.0f}  {100 * n / total:5.1f}%")
  order = sorted(range(len(rows)), key=lambda i: -_num(rows[i][SAMPLES]))
  print("\nmost sampled instructions (index, samples, share, executed, main reasons):")
  for i in order[:int(top)]:
    r = rows[i]
    n = _num(r[SAMPLES])
    main_ = sorted(((_num(r[c]), c[6:]) for c in reasons), reverse=True)[:3]
    why = ", ".join(f"{c} {v:.0f}" for v, c in main_ if v)
    if context:
      for j in range(max(0, i - int(context)), i):
        print(f"      {j:5d}  {rows[j]['Source'].strip()}")
    print(f"  {i:5d} {n:7.0f} {100 * n / total:5.1f}% {r['Instructions Executed']:>9s}  "
          f"{r['Source'].strip()[:60]:60s} {why}")


if __name__ == "__main__":
  main(*sys.argv[1:])
