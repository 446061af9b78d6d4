"""Reconstruction error of the statistical quantizer's two roundings, this trainer's "centred" bins
and the official code's "paper" round(c/s + n/2), on the same rows in the same command.

    python benchmarks/statistical_rounding.py [--rows 256] [--cols 1024] [--seeds 3]

Rows are N(0, 1) and Student-t with 3 degrees of freedom (heavy tails, like pseudogradients with
outliers). The error is ||x - deQ(Q(x))|| / ||x|| over all rows, the mean over seeds; the last line
(JSON) holds every number and the ratio paper / centred per setting (> 1: the paper rounding loses more).
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch


from muloco.diloco.compression import Compressor
from muloco.diloco.config import CompressionConfig

ROUNDINGS = ("centred", "paper")


def rows(distribution: str, shape: tuple[int, int], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if distribution == "gaussian":
        return torch.randn(shape, generator=generator)
    # Student-t(3): a normal over the root of a chi-square(3) / 3.
    chi2 = torch.randn((*shape, 3), generator=generator).square().sum(dim=-1) / 3
    return torch.randn(shape, generator=generator) / chi2.sqrt()


def relative_error(x: torch.Tensor, bits: int, rounding: str) -> float:
    compressor = Compressor(CompressionConfig(method="statistical", bits=bits, statistical_rounding=rounding))
    decoded = compressor.decode(compressor.encode(x).data, x.shape)
    return float((decoded - x).norm() / x.norm())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--seeds", type=int, default=3)
    args = p.parse_args()
    results = []
    print(f"{'rows':>10} {'bits':>4} {'centred':>9} {'paper':>9} {'paper/centred':>14}")
    for distribution in ("gaussian", "student_t3"):
        for bits in (2, 4, 8):
            errors = {r: statistics.fmean(relative_error(rows(distribution, (args.rows, args.cols), seed), bits, r)
                                          for seed in range(args.seeds)) for r in ROUNDINGS}
            ratio = errors["paper"] / errors["centred"]
            print(f"{distribution:>10} {bits:>4} {errors['centred']:>9.4f} {errors['paper']:>9.4f} {ratio:>14.3f}")
            results.append({"rows": distribution, "bits": bits, **errors, "paper_over_centred": ratio})
    print(json.dumps({"shape": [args.rows, args.cols], "seeds": args.seeds, "relative_error": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
