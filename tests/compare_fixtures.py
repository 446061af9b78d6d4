"""Records of the method comparison made up for its tests: a run's and an alignment branch's record at
the tests' settings, and a synthetic corpus (each method's final loss as a function of its lrs and seed,
each branch's cosine) for the selection, the sweep and the report to run on."""
from __future__ import annotations

import math
from dataclasses import replace

from tools.compare.methods import METHOD_ORDER
from tools.compare.protocol import Method, RunSpec, Settings
from tools.compare.records import AlignmentRecord, BranchKey, RunRecord

SETTINGS = Settings(steps=60, sync_interval=10, warmup=5)


HASHES = {m: Method.load(m).config_sha256 for m in METHOD_ORDER}


DATA = "d" * 64  # the prepared data's digest


def run_record(method="dp_muon", lr=0.02, outer=None, seed=0, loss=5.0, **changes) -> RunRecord:
    return replace(RunRecord("shakespeare", DATA, method, lr, outer, seed, SETTINGS.protocol(), HASHES[method], loss,
                             [[10, loss + 1], [60, loss]], [[10, 1e6], [60, 2e6]], None, 12.5, "abc"), **changes)


def alignment_record(method="muloco_k2", x=1.0, seed=1, step=20, cosine=0.8, **changes) -> AlignmentRecord:
    return replace(AlignmentRecord("shakespeare", DATA, method, x, seed, step, 0.02 * x, f"dp_muon_lr0.02_s{seed}",
                                   SETTINGS.protocol(), HASHES[method], cosine, 1.1, {"a": cosine, "b": cosine - 0.1},
                                   30.0, "abc"), **changes)


LR_BEST = {"adamw": 3e-3, "muon": 0.02}


# Final val loss at the best lrs by method, before a seed's shift.
BASE = {"dp_adamw": 4.40, "dp_muon": 4.10, "muloco_k1": 4.12, "diloco_k1": 4.45, "muloco_k2": 4.30,
        "diloco_k2": 4.80, "muloco_k4": 4.40, "diloco_k4": 4.85, "muloco_k8": 4.55, "diloco_k8": 5.10,
        "muloco_k4_stat4": 4.401, "diloco_k4_stat4": 4.84, "muloco_k4_stat2ef": 4.44, "muloco_k4_lin2ef": 4.45,
        "muloco_k8_stat4": 4.551, "diloco_k8_stat4": 5.09, "muloco_k8_stat2ef": 4.58, "muloco_k8_lin2ef": 4.62,
        "muloco_k8_stat2ef_tensor": 4.585, "muloco_k8_lin2ef_tensor": 4.70, "muloco_k8_stat2ef_emb2": 4.59,
        "muloco_k8_sparseloco": 4.65}


SEED_SHIFT = {0: 0.0, 1: 0.1, 2: -0.05, 3: 0.2, 4: 0.05, 5: -0.1}


NOISE = {1: 0.004, 2: -0.003, 3: 0.0, 4: 0.002, 5: -0.001}  # per-seed jitter, so intervals have width


MULOCO_K1_NOISE = {0: 0.0, 1: 0.01, 2: -0.01, 3: 0.03, 4: 0.0, 5: 0.02}  # (a) as the first protocol saw it


def fake_loss(spec: RunSpec) -> float:
    method = Method.load(spec.method)
    lr_penalty = abs(math.log(spec.inner_lr / LR_BEST[method.optimizer]))
    outer_penalty = 0.0 if spec.outer_lr is None else abs(spec.outer_lr - (method.outer[0])) * 0.1
    jitter = NOISE.get(spec.seed, 0.0) * (1 + METHOD_ORDER.index(spec.method) % 3)
    if spec.method == "muloco_k1":  # seed 0 favours it a lot; the others put it 0.5% above DP Muon, noisily
        jitter += -0.5 if spec.seed == 0 else MULOCO_K1_NOISE[spec.seed]
    return BASE[spec.method] + lr_penalty + outer_penalty + SEED_SHIFT[spec.seed] + jitter


def fake_cosine(key: BranchKey) -> float:
    k = Method.load(key.method).workers
    return (0.9 if key.method.startswith("muloco") else 0.8) - 0.05 * math.log2(k) - 0.01 * key.lr_multiplier \
        + NOISE[key.seed]
