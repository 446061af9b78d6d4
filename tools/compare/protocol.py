"""The comparison's protocol: settings, methods as configs, and what each phase runs next.

Settings are chosen on the selection seed alone and judged on the test seeds alone, so the seed that
picked a setting never tests it (no winner's curse). Each phase is a pure function of the finished
runs, which the scheduler (tools/compare/sweep.py) calls again after every run:
1. selection, on the selection seed: the inner-lr grid (LR_GRIDS) at the paper's outer lr; while the
   best inner lr is the smallest or largest tried, one more a geometric step beyond that edge (at most
   MAX_EXTENSIONS); then, for methods with an outer loop, the outer-lr grid (OUTER_LR_GRID) at the best
   inner lr, extending itself the same way. A compressed variant selects nothing: it runs at its
   uncompressed method's setting (methods.py `tuned_as`);
2. test: the selected setting on each test seed (3; 5 where a claim is inconclusive on the first 3,
   tools/compare/claims.py); a data-parallel baseline's test runs keep their checkpoints at the
   alignment's start steps;
3. alignment (tools/compare/alignment.py): branches from those start states.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from tools.compare.methods import BY_NAME, METHOD_ORDER, UNCOMPRESSED, MethodSpec
from muloco.core.typed_json import read_json_object
from trainer.ds_config import DsConfig, load_ds_config
from trainer.model.presets import PRESETS

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO / "configs" / "compare"
DEFAULT_CORPUS = REPO / "corpus" / "shakespeare"
MODEL, ARCH = "tiny", "paper"
QUERY_GROUPS = PRESETS[MODEL].num_attention_heads  # one per head: the paper's attention (no GQA)
VOCAB_SIZE = 4096  # the tokenizer trained per corpus
MAX_EXTENSIONS = 3


@dataclass(frozen=True)
class Grid:
    """Initial points of a tuning grid and the geometric step of an extension beyond its edge."""
    points: tuple[float, ...]
    step: float

    def initial(self, size: int) -> tuple[float, ...]:
        """The middle `size` points."""
        start = (len(self.points) - size) // 2
        return self.points[start:start + size]


LR_GRIDS = {"adamw": Grid((1e-3, 3e-3, 1e-2), 10 ** 0.5), "muon": Grid((0.01, 0.02, 0.04), 2.0)}
# Both of the paper's tuned points (K=1: 0.7, K>1: 1.0), a step of sqrt(2) apart.
OUTER_LR_GRID = Grid((0.5, 0.7, 1.0), 2 ** 0.5)


@dataclass(frozen=True)
class Settings:
    steps: int = 300
    sync_interval: int = 30
    warmup: int = 20
    global_batch: int = 16  # sequences of the tiny preset's 128 tokens; B/K = 2 at K = 8
    eval_batches: int = 4  # E: validation sequences = E * global_batch
    selection_seed: int = 0
    test_seeds: tuple[int, ...] = (1, 2, 3)
    more_test_seeds: tuple[int, ...] = (4, 5)  # where a claim is inconclusive on test_seeds
    methods: tuple[str, ...] = METHOD_ORDER
    lr_grid_size: int = 3  # the middle n of each grid
    outer_tuning: bool = True
    alignment: bool = True
    control_seeds: int = 1  # the alignment's 0.5x / 2x lr controls run on this many of the test seeds
    run_timeout_s: int = 3600

    def __post_init__(self):
        if self.steps % self.sync_interval:
            raise ValueError(f"steps {self.steps} must be a multiple of the sync interval {self.sync_interval}")
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warm-up {self.warmup} must be between 0 and the {self.steps} steps")
        if not 2 <= self.lr_grid_size <= 3:
            raise ValueError(f"the lr grid needs 2 or 3 points to have edges, got {self.lr_grid_size}")
        if self.selection_seed in (*self.test_seeds, *self.more_test_seeds):
            raise ValueError(f"the selection seed {self.selection_seed} cannot also be a test seed")
        unknown = [m for m in self.methods if m not in BY_NAME]
        if unknown:
            raise ValueError(f"unknown methods {unknown}; the comparison has {list(METHOD_ORDER)}")

    def inner_grid(self, optimizer: str) -> tuple[float, ...]:
        return LR_GRIDS[optimizer].initial(self.lr_grid_size)

    def protocol(self) -> dict:
        """What makes two runs of the same method, lrs and seed the same run (recorded with each)."""
        return {"steps": self.steps, "sync_interval": self.sync_interval, "warmup": self.warmup,
                "global_batch": self.global_batch, "eval_batches": self.eval_batches, "model": MODEL,
                "arch": ARCH, "query_groups": QUERY_GROUPS, "vocab_size": VOCAB_SIZE,
                "selection_seed": self.selection_seed}


QUICK = Settings(steps=60, sync_interval=10, warmup=6, test_seeds=(), more_test_seeds=(),
                 methods=("dp_adamw", "dp_muon", "diloco_k1", "muloco_k1", "diloco_k4", "muloco_k4"),
                 lr_grid_size=2, outer_tuning=False, alignment=False)
# The corpora other than the default run the methods whose claims need no compression.
SECOND_CORPUS_METHODS = UNCOMPRESSED


@dataclass(frozen=True)
class Method:
    spec: MethodSpec
    config: dict  # the JSON, as the runs' ds_configs are written from it
    ds: DsConfig  # the same, as the trainer reads it

    @classmethod
    def load(cls, name: str) -> Method:
        path = CONFIG_DIR / f"{name}.json"
        if name not in BY_NAME or not path.exists():
            raise SystemExit(f"unknown method {name!r}: not in tools/compare/methods.py or no {path}")
        config = read_json_object(path)
        return cls(BY_NAME[name], config, load_ds_config(config))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def workers(self) -> int:
        return self.ds.muloco.workers if self.ds.muloco is not None else 1

    @property
    def optimizer(self) -> str:
        return self.ds.optimizer.type

    @property
    def outer(self) -> tuple[float, float] | None:
        """The config's (outer lr, momentum): the paper's tuned point; None for DP."""
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
        muloco = self.ds.muloco
        c = muloco.compression
        codec = (f"top-{c.topk_fraction:.0%} ({c.topk_value_bits}-bit values)" if c.method == "topk" else
                 f"{c.method} {c.bits}-bit")
        groups = "" if c.granularity == "row" else f" per {c.granularity}"
        collective = "" if muloco.collective == "all_gather" else f", {muloco.collective}"
        return (f"{codec}{groups} (emb {c.embedding_bits}, 1-D {c.vector_bits})" + (" + EF" if c.error_feedback else "")
                + collective)


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
    """One training run a phase asks for; `start_states`: keep its checkpoints at the alignment's start steps."""
    spec: RunSpec
    start_states: bool = False


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


def _at_edge(value: float, tried: list[float]) -> bool:
    return len(tried) > 1 and value in (min(tried), max(tried))


@dataclass(frozen=True)
class Selection:
    """A method's setting chosen on the selection seed (its run there, and whether each lr is still
    at an edge of those tried after the extensions)."""
    spec: RunSpec
    loss: float
    inner_at_edge: bool
    outer_at_edge: bool


def _selection_losses(name: str, settings: Settings, losses: Mapping[RunSpec, float]) -> dict[RunSpec, float]:
    return {s: v for s, v in losses.items() if s.method == name and s.seed == settings.selection_seed}


def selection_launch(method: Method, settings: Settings, losses: Mapping[RunSpec, float]) -> Launch | None:
    """The next run of `method`'s selection, or None when it is complete (or it selects nothing)."""
    if method.spec.tuned_as is not None:
        return None
    mine = _selection_losses(method.name, settings, losses)
    seed, paper_outer = settings.selection_seed, method.outer[0] if method.outer else None
    initial = settings.inner_grid(method.optimizer)
    for lr in initial:
        if RunSpec(method.name, lr, paper_outer, seed) not in mine:
            return Launch(RunSpec(method.name, lr, paper_outer, seed))
    inner = {s.inner_lr: v for s, v in mine.items() if s.outer_lr == paper_outer}
    lr = extension_lr(inner, initial, LR_GRIDS[method.optimizer].step)
    if lr is not None:
        return Launch(RunSpec(method.name, lr, paper_outer, seed))
    if paper_outer is None or not settings.outer_tuning:
        return None
    best_inner = min(inner, key=inner.get)
    for outer_lr in OUTER_LR_GRID.points:
        if RunSpec(method.name, best_inner, outer_lr, seed) not in mine:
            return Launch(RunSpec(method.name, best_inner, outer_lr, seed))
    outer = {s.outer_lr: v for s, v in mine.items() if s.inner_lr == best_inner}
    outer_lr = extension_lr(outer, OUTER_LR_GRID.points, OUTER_LR_GRID.step)
    return None if outer_lr is None else Launch(RunSpec(method.name, best_inner, outer_lr, seed))


def selection(method: Method, settings: Settings, losses: Mapping[RunSpec, float]) -> Selection | None:
    """`method`'s chosen setting once its selection (or its `tuned_as` method's) is complete."""
    tuner = Method.load(method.spec.tuned_as) if method.spec.tuned_as else method
    if selection_launch(tuner, settings, losses) is not None:
        return None
    mine = _selection_losses(tuner.name, settings, losses)
    if not mine:
        return None
    best = min(mine, key=mine.get)
    paper_outer = tuner.outer[0] if tuner.outer else None
    inner = [s.inner_lr for s in mine if s.outer_lr == paper_outer]
    outer = [s.outer_lr for s in mine if s.inner_lr == best.inner_lr and s.outer_lr is not None]
    return Selection(replace(best, method=method.name), mine[best], _at_edge(best.inner_lr, inner),
                     best.outer_lr is not None and _at_edge(best.outer_lr, outer))


def seed_launch(method: Method, settings: Settings, losses: Mapping[RunSpec, float], seeds: tuple[int, ...],
                start_state_seeds: tuple[int, ...] = ()) -> Launch | None:
    """The next test run of `method` (its selected setting on each of `seeds`, keeping its start states
    on `start_state_seeds`), or None."""
    chosen = selection(method, settings, losses)
    if chosen is None:
        return None
    for seed in seeds:
        spec = replace(chosen.spec, seed=seed)
        if spec not in losses:
            return Launch(spec, seed in start_state_seeds)
    return None
