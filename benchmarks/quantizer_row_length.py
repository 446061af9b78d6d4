"""Reconstruction error of linear (per-row min-max) and statistical (per-row sigma) quantization
against the row length, on the same rows in the same command: why the comparison's (d3) verdict,
decided on 128-wide rows, need not hold on a 150M model's 1024-4096-wide ones.

    python benchmarks/quantizer_row_length.py [--rows 256] [--row-lengths 128 1024 4096] [--seeds 3]

Both quantizers scale each row by one statistic of that row: the linear one by its range, which
grows with the row's length (its extremes do), the statistical one by its standard deviation, which
does not. Rows are N(0, 1) and Student-t(3) (heavy tails), as in statistical_rounding.py. The error is
||x - deQ(Q(x))|| / ||x||, the mean over seeds; the last line (JSON) holds every number and the ratio
linear / statistical (> 1: linear loses more).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
from statistical_rounding import rows  # this folder is the script's own path entry

from muloco.diloco.compression import Compressor
from muloco.diloco.config import CompressionConfig

METHODS = ("linear", "statistical")


def relative_error(x: torch.Tensor, method: str, bits: int) -> float:
    compressor = Compressor(CompressionConfig(method=method, bits=bits))
    decoded = compressor.decode(compressor.encode(x).data, x.shape)
    return float((decoded - x).norm() / x.norm())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--row-lengths", type=int, nargs="+", default=[128, 1024, 4096])
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    results = []
    print(f"{'rows':>10} {'bits':>4} {'length':>6} {'linear':>8} {'statistical':>11} {'linear/statistical':>18}")
    for distribution in ("gaussian", "student_t3"):
        for bits in (2, 4):
            for length in args.row_lengths:
                errors = {m: statistics.fmean(relative_error(rows(distribution, (args.rows, length), seed), m, bits)
                                              for seed in range(args.seeds)) for m in METHODS}
                ratio = errors["linear"] / errors["statistical"]
                print(f"{distribution:>10} {bits:>4} {length:>6} {errors['linear']:>8.3f} "
                      f"{errors['statistical']:>11.3f} {ratio:>18.2f}")
                results.append({"rows": distribution, "bits": bits, "row_length": length, **errors,
                                "linear_over_statistical": ratio})
    print(json.dumps({"rows_per_matrix": args.rows, "seeds": args.seeds, "relative_error": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
