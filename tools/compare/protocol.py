"""The comparison's protocol: methods, settings, and what each method's sweep runs next.

A method's sweep is sequential and depends only on the finished runs, so it is a pure function here
(`next_launch`) that the scheduler calls again after every run:
1. the inner-lr grid (LR_GRIDS) on the first seed, at the config's outer lr;
2. grid extension: while the best lr on the first seed is the smallest or largest tried, one more lr a
   geometric step (LR_STEP, the grid's own ratio) beyond that edge, at most MAX_EXTENSIONS times;
3. methods with an outer loop: one neighbour of the paper's tuned outer lr at the best inner lr;
4. the best setting of the first seed with every other seed;
5. with alignment on, K > 1 methods: every seed at the best setting runs with the alignment
   measurement (tools/compare/alignment.py); the first seed's run, made before the best was known,
   is rerun once for it.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from trainer.ds_config import DsConfig, load_ds_config, read_json_object

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs" / "compare"
DEFAULT_CORPUS = REPO / "corpus" / "shakespeare"
MODEL = "tiny"
VOCAB_SIZE = 4096  # the tokenizer trained per corpus

LR_GRIDS = {"adamw": (1e-3, 3e-3, 1e-2), "muon": (0.01, 0.02, 0.04)}
# Geometric step of a grid extension: the grids' own ratio (half a decade for AdamW, x2 for Muon).
LR_STEP = {"adamw": 10 ** 0.5, "muon": 2.0}
MAX_EXTENSIONS = 3
# One neighbour of the paper's tuned outer lr, keyed by the tuned point (K=1 and K>1).
OUTER_LR_NEIGHBOUR = {0.7: 0.5, 1.0: 0.8}
METHOD_ORDER = ("dp_adamw", "dp_muon", "diloco_k1", "muloco_k1", "diloco_k2", "muloco_k2", "diloco_k4",
                "muloco_k4", "diloco_k4_stat4", "muloco_k4_stat4", "diloco_k4_stat2ef", "muloco_k4_stat2ef",
                "muloco_k4_lin2ef", "muloco_k4_stat4_paper", "muloco_k4_stat4_emb8")
# What issue 17's protocol requires on each corpus (the others are extras).
REQUIRED_METHODS = ("dp_adamw", "dp_muon", "diloco_k1", "muloco_k1", "diloco_k2", "muloco_k2", "diloco_k4",
                    "muloco_k4", "diloco_k4_stat4", "muloco_k4_stat4", "muloco_k4_stat2ef", "muloco_k4_lin2ef")
QUICK_METHODS = ("dp_adamw", "dp_muon", "diloco_k1", "muloco_k1", "diloco_k4", "muloco_k4", "muloco_k4_stat4",
                 "muloco_k4_stat2ef")


@dataclass(frozen=True)
class Settings:
    steps: int = 300
    sync_interval: int = 30
    warmup: int = 20
    global_batch: int = 16  # sequences of the tiny preset's 128 tokens
    eval_batches: int = 4  # E: validation sequences = E * global_batch
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = REQUIRED_METHODS
    lr_grid_size: int = 3  # the first n of each LR_GRIDS entry, centred on the middle value
    outer_neighbours: bool = True
    alignment: bool = True
    run_timeout_s: int = 3600

    def __post_init__(self):
        if self.steps % self.sync_interval:
            raise ValueError(f"steps {self.steps} must be a multiple of the sync interval {self.sync_interval}")
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warm-up {self.warmup} must be between 0 and the {self.steps} steps")
        if not 2 <= self.lr_grid_size <= 3:
            raise ValueError(f"the lr grid needs 2 or 3 points to have edges, got {self.lr_grid_size}")

    def lr_grid(self, optimizer: str) -> tuple[float, ...]:
        grid = LR_GRIDS[optimizer]
        start = (len(grid) - self.lr_grid_size) // 2
        return grid[start:start + self.lr_grid_size]

    def protocol(self) -> dict:
        """What makes two runs of the same method, lr and seed the same run (recorded with each)."""
        return {"steps": self.steps, "sync_interval": self.sync_interval, "warmup": self.warmup,
                "global_batch": self.global_batch, "eval_batches": self.eval_batches, "model": MODEL,
                "vocab_size": VOCAB_SIZE}


QUICK = Settings(steps=60, sync_interval=10, warmup=6, seeds=(0,), methods=QUICK_METHODS, lr_grid_size=2,
                 outer_neighbours=False, alignment=False)


@dataclass(frozen=True)
class Method:
    name: str
    config: dict  # the JSON, as the runs' ds_configs are written from it
    ds: DsConfig  # the same, as the trainer reads it

    @classmethod
    def load(cls, name: str) -> Method:
        path = CONFIG_DIR / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"unknown method {name!r}: no {path}")
        config = read_json_object(path)
        return cls(name, config, load_ds_config(config))

    @property
    def workers(self) -> int:
        return self.ds.muloco.workers if self.ds.muloco is not None else 1

    @property
    def optimizer(self) -> str:
        return self.ds.optimizer.type

    @property
    def outer(self) -> tuple[float, float] | None:
        """The config's (outer lr, momentum); None for DP."""
        muloco = self.ds.muloco
        return (muloco.outer_lr, muloco.outer_momentum) if muloco is not None else None

    @property
    def config_sha256(self) -> str:
        """Of the config's content: a record made with another version of the config is not this method's."""
        return hashlib.sha256(json.dumps(self.config, sort_keys=True).encode()).hexdigest()

    @property
    def compression(self) -> str:
        if self.ds.muloco is None or self.ds.muloco.compression.method == "none":
            return "none"
        c = self.ds.muloco.compression
        return f"{c.method} {c.bits}-bit (emb {c.embedding_bits}, 1-D {c.vector_bits})" + (" + EF" if c.error_feedback
                                                                                           else "")

    @property
    def aligned(self) -> bool:
        """Whether the alignment measure means something: K = 1 averages one worker (cosine 1 by construction)."""
        return self.workers > 1


@dataclass(frozen=True)
class RunSpec:
    method: str
    inner_lr: float
    outer_lr: float | None
    seed: int

    @property
    def name(self) -> str:
        outer = "" if self.outer_lr is None else f"_olr{self.outer_lr:g}"
        return f"{self.method}_lr{self.inner_lr:g}{outer}_s{self.seed}"


@dataclass(frozen=True)
class Launch:
    """One launch a sweep asks for: a run, with or without the alignment measurement."""
    spec: RunSpec
    alignment: bool


def extension_lr(losses: Mapping[float, float], initial: tuple[float, ...], step: float,
                 max_extensions: int = MAX_EXTENSIONS) -> float | None:
    """The next lr to try when the best of `losses` (lr -> val loss) is at an edge of the lrs tried,
    one geometric `step` beyond it (2 significant digits); None when the best is inside, or after
    `max_extensions` lrs outside the `initial` grid."""
    lrs = sorted(losses)
    if sum(lr not in initial for lr in lrs) >= max_extensions:
        return None
    best = min(lrs, key=lambda lr: losses[lr])
    if best == lrs[0]:
        return float(f"{best / step:.2g}")
    if best == lrs[-1]:
        return float(f"{best * step:.2g}")
    return None


def best_spec(method: Method, settings: Settings, losses: Mapping[RunSpec, float]) -> RunSpec | None:
    """The first seed's best run of `method` so far (inner and outer lr)."""
    first = [s for s in losses if s.method == method.name and s.seed == settings.seeds[0]]
    return min(first, key=lambda s: losses[s]) if first else None


def next_launch(method: Method, settings: Settings, losses: Mapping[RunSpec, float],
                aligned: set[RunSpec]) -> Launch | None:
    """What `method`'s sweep runs next given the finished runs (`losses`: spec -> final val loss;
    `aligned`: specs whose alignment is measured), or None when its sweep is complete."""
    first = settings.seeds[0]
    outer = method.outer[0] if method.outer else None
    for lr in settings.lr_grid(method.optimizer):
        spec = RunSpec(method.name, lr, outer, first)
        if spec not in losses:
            return Launch(spec, False)
    tried = {s.inner_lr: loss for s, loss in losses.items()
             if s.method == method.name and s.seed == first and s.outer_lr == outer}
    lr = extension_lr(tried, settings.lr_grid(method.optimizer), LR_STEP[method.optimizer])
    if lr is not None:
        return Launch(RunSpec(method.name, lr, outer, first), False)
    if settings.outer_neighbours and outer is not None:
        spec = RunSpec(method.name, min(tried, key=tried.get), OUTER_LR_NEIGHBOUR[outer], first)
        if spec not in losses:
            return Launch(spec, False)
    best = best_spec(method, settings, losses)
    wants_alignment = settings.alignment and method.aligned
    for seed in settings.seeds:
        spec = replace(best, seed=seed)
        if spec not in losses or (wants_alignment and spec not in aligned):
            return Launch(spec, wants_alignment)
    return None
