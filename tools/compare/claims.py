"""The paper's claims as paired tests (tools/compare/verdicts.py) over the test seeds' results, and
which methods need more seeds because a claim is still undecided on the first test seeds."""
from __future__ import annotations

from dataclasses import dataclass, replace

from tools.compare.methods import KS
from tools.compare.verdicts import (INCONCLUSIVE, LOSSLESS_MARGIN, MIN_SEEDS, NON_INFERIORITY_MARGIN, NOT_RUN, PENDING,
                                    Stat, Test, all_of, less, non_inferior, smaller_increase, smaller_relative_gap)

# The paper's 150M numbers (arXiv 2505.23725, final eval loss) by method; K=16 where it reports K>1.
PAPER_150M = {"dp_adamw": 3.158, "dp_muon": 3.124, "muloco_k1": 3.120, "diloco_k1": 3.142}
ALIGNED_KS = KS[1:]
LARGE_KS = (4, 8)  # "for K > 2"


@dataclass(frozen=True)
class Claim:
    key: str
    text: str
    paper: str
    tests: tuple[Test, ...]
    verdict: str
    needs: tuple[str, ...]  # the methods it compares: NOT_RUN on a corpus that runs fewer
    on_alignment: bool = False  # tested on the alignment measure, not on val losses


def _claim(key, text, paper, tests, needs, on_alignment=False) -> Claim:
    return Claim(key, text, paper, tuple(tests), all_of([t.verdict for t in tests]), tuple(needs), on_alignment)


def claims(loss: dict[str, Stat], alignment: dict[str, Stat], methods: tuple[str, ...]) -> list[Claim]:
    """Every claim on the given stats (method -> per-seed final val loss / mean cosine with the K=1
    reference at the method's lr); a claim needing a method outside `methods` is NOT_RUN, one needing
    a method with no test seed yet is PENDING."""
    def lo(name):
        return loss.get(name)

    def al(name):
        return alignment.get(name)

    rows = [
        _claim("a", "MuLoCo K=1 ≤ DP Muon < DP AdamW", "150M: MuLoCo K=1 3.120, DP Muon 3.124, DP AdamW 3.158",
               [non_inferior(lo("muloco_k1"), lo("dp_muon"), f"MuLoCo K=1 − DP Muon (margin {NON_INFERIORITY_MARGIN:.1%})"),
                less(lo("dp_muon"), lo("dp_adamw"), "DP AdamW − DP Muon")],
               ("muloco_k1", "dp_muon", "dp_adamw")),
        _claim("b", "MuLoCo beats DiLoCo at every K",
               "150M: K=1 MuLoCo 3.120 vs DiLoCo 3.142; K=16 MuLoCo 3.222 vs DiLoCo 3.326",
               [less(lo(f"muloco_k{k}"), lo(f"diloco_k{k}"), f"DiLoCo − MuLoCo at K={k}") for k in KS],
               [f"{m}_k{k}" for k in KS for m in ("muloco", "diloco")]),
        _claim("c", f"MuLoCo degrades less than DiLoCo from K=1 to K={KS[-1]}",
               "150M K=1 → K=16: MuLoCo +0.102 (3.120 → 3.222), DiLoCo +0.184 (3.142 → 3.326)",
               [smaller_increase(lo("muloco_k1"), lo(f"muloco_k{KS[-1]}"), lo("diloco_k1"), lo(f"diloco_k{KS[-1]}"),
                                 f"DiLoCo's increase − MuLoCo's, K=1 → K={KS[-1]}")],
               ("muloco_k1", f"muloco_k{KS[-1]}", "diloco_k1", f"diloco_k{KS[-1]}")),
        _claim("c2", "For K > 2, MuLoCo beats DiLoCo relative to their DP baselines",
               "150M K=16: MuLoCo 3.222 vs DP Muon 3.124 (+3.1%), DiLoCo 3.326 vs DP AdamW 3.158 (+5.3%)",
               [smaller_relative_gap(lo(f"muloco_k{k}"), lo("dp_muon"), lo(f"diloco_k{k}"), lo("dp_adamw"),
                                     f"DiLoCo/DP AdamW − MuLoCo/DP Muon at K={k}") for k in LARGE_KS],
               ("dp_muon", "dp_adamw", *[f"{m}_k{k}" for k in LARGE_KS for m in ("muloco", "diloco")])),
        _claim("d1", f"4-bit statistical is effectively lossless (within {LOSSLESS_MARGIN:.0%})",
               "qualitative: 4-bit quantization matches the uncompressed loss",
               [non_inferior(lo(f"{m}_k4_stat4"), lo(f"{m}_k4"), f"{label} 4-bit − uncompressed, K=4", LOSSLESS_MARGIN)
                for m, label in (("muloco", "MuLoCo"), ("diloco", "DiLoCo"))],
               ("muloco_k4_stat4", "muloco_k4", "diloco_k4_stat4", "diloco_k4")),
        _claim("d2", f"2-bit statistical + EF works (MuLoCo, within {LOSSLESS_MARGIN:.0%})",
               "qualitative: 2-bit statistical quantization with error feedback stays close to uncompressed",
               [non_inferior(lo("muloco_k4_stat2ef"), lo("muloco_k4"), "MuLoCo 2-bit statistical + EF − uncompressed",
                             LOSSLESS_MARGIN)],
               ("muloco_k4_stat2ef", "muloco_k4")),
        _claim("d3", "2-bit linear + EF degrades (worse than 2-bit statistical + EF, MuLoCo)",
               "qualitative: 2-bit linear quantization degrades the loss",
               [less(lo("muloco_k4_stat2ef"), lo("muloco_k4_lin2ef"), "linear − statistical, 2-bit + EF")],
               ("muloco_k4_stat2ef", "muloco_k4_lin2ef")),
        # The codec at the paper's settings (issue 44): K=8, the reduce-scatter re-quantizing the average.
        _claim("d1'", f"At K=8 over the reduce-scatter, 4-bit statistical is effectively lossless (within "
                      f"{LOSSLESS_MARGIN:.0%})", "qualitative: 4-bit quantization matches the uncompressed loss",
               [non_inferior(lo(f"{m}_k8_stat4"), lo(f"{m}_k8"), f"{label} 4-bit − uncompressed, K=8", LOSSLESS_MARGIN)
                for m, label in (("muloco", "MuLoCo"), ("diloco", "DiLoCo"))],
               ("muloco_k8_stat4", "muloco_k8", "diloco_k8_stat4", "diloco_k8")),
        _claim("d2'", f"At K=8 over the reduce-scatter, 2-bit statistical + EF works (MuLoCo, within "
                      f"{LOSSLESS_MARGIN:.0%})",
               "qualitative: 2-bit statistical quantization with error feedback stays close to uncompressed",
               [non_inferior(lo("muloco_k8_stat2ef"), lo("muloco_k8"), "MuLoCo 2-bit statistical + EF − uncompressed, "
                             "K=8", LOSSLESS_MARGIN)],
               ("muloco_k8_stat2ef", "muloco_k8")),
        _claim("d3'", "At K=8 over the reduce-scatter, 2-bit linear + EF degrades (worse than 2-bit statistical + "
                      "EF, MuLoCo), per row and per tensor",
               "qualitative: 2-bit linear quantization degrades the loss",
               [less(lo(f"muloco_k8_stat2ef{g}"), lo(f"muloco_k8_lin2ef{g}"), f"linear − statistical, 2-bit + EF, {label}")
                for g, label in (("", "per row"), ("_tensor", "per tensor"))],
               [f"muloco_k8_{q}2ef{g}" for g in ("", "_tensor") for q in ("stat", "lin")]),
        *[_claim(key, f"{text} stays within {LOSSLESS_MARGIN:.0%} of uncompressed (MuLoCo K=8)",
                 f"the project's goal, not the paper's: >= 400x fewer bytes than DP ({bytes_})",
                 [non_inferior(lo(method), lo("muloco_k8"), f"{text} − uncompressed, K=8", LOSSLESS_MARGIN)],
                 (method, "muloco_k8"))
          for key, method, text, bytes_ in (
              ("g1", "muloco_k8_stat2ef_emb2", "2-bit statistical + EF on every matrix (embeddings and head too), "
                                               "reduce-scatter,", "results/compression_groups.md"),
              ("g2", "muloco_k8_sparseloco", "SparseLoCo (top-2% per tensor, 2-bit values, EF) on every matrix, "
                                             "all-gather,", "results/compression_groups.md"))],
        _claim("e", "MuLoCo's averaged pseudogradient is better aligned with the K=1 one than DiLoCo's (K = 2, 4, 8)",
               "Fig. 4: higher cosine with the K=1 pseudogradient for MuLoCo than DiLoCo",
               [less(al(f"diloco_k{k}"), al(f"muloco_k{k}"), f"MuLoCo − DiLoCo cosine at K={k}") for k in ALIGNED_KS],
               [f"{m}_k{k}" for k in ALIGNED_KS for m in ("muloco", "diloco")], on_alignment=True),
    ]
    def state(c: Claim) -> str:
        if not all(n in methods for n in c.needs):
            return NOT_RUN
        return c.verdict if all(n in (alignment if c.on_alignment else loss) for n in c.needs) else PENDING

    return [replace(c, verdict=state(c)) for c in rows]


def undecided(claims_on_first_seeds: list[Claim]) -> list[Claim]:
    """The claims inconclusive although every test had its MIN_SEEDS seeds: they get more seeds."""
    return [c for c in claims_on_first_seeds if c.verdict == INCONCLUSIVE and all(t.n >= MIN_SEEDS for t in c.tests)]
