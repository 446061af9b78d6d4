"""The paper's method comparison at CPU scale: DP AdamW, DP Muon, DiLoCo and MuLoCo at K = 1, 2, 4,
with pseudogradient compression none / 4-bit / 2-bit + error feedback, on the shakespeare corpus.

    python tools/compare_methods.py --out results/compare [--quick] [--steps N] [--seeds 0 1 2]
        [--methods dp_adamw muloco_k4 ...] [--work-dir runs/compare]

Each method is a ds_config in configs/compare/ and runs as the real trainer (`deepspeed --num_gpus K
trainer/pretrain.py`, one rank per worker, D = P = T = 1). Protocol:
- same tokens for every method: B sequences per step for N steps; the global batch is split over the
  K workers (micro-batch B/K per worker, as in the paper);
- the inner lr is tuned per method on the first seed over a small grid (LR_GRIDS); methods with an
  outer loop also try one neighbour of the paper's tuned outer lr (K=1: 0.7/0.6, K>1: 1.0/0.9) at
  their best inner lr; the best setting is then rerun with the remaining seeds;
- validation loss on the valid split right after each outer sync (every H steps, on the synced global
  weights), the same E*B validation sequences for every method;
- compressed configs quantize every tensor (`uncompressed_small: false`), as the paper does.
Outputs in --out: runs.csv (every run), summary.csv and README table rows (table.md), val loss against
steps and against bytes sent (PNG). Runs are cached in --work-dir: a rerun skips finished ones.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG_DIR = REPO / "configs" / "compare"
CORPUS = REPO / "corpus" / "shakespeare"

LR_GRIDS = {"adamw": (1e-3, 3e-3, 1e-2), "muon": (0.01, 0.02, 0.04)}
# One neighbour of the paper's tuned outer lr, keyed by the tuned point (K=1 and K>1).
OUTER_LR_NEIGHBOUR = {0.7: 0.5, 1.0: 0.8}
METHOD_ORDER = ("dp_adamw", "dp_muon", "diloco_k1", "muloco_k1", "diloco_k2", "muloco_k2", "diloco_k4",
                "muloco_k4", "diloco_k4_stat4", "muloco_k4_stat4", "diloco_k4_stat2ef", "muloco_k4_stat2ef",
                "muloco_k4_stat4_paper", "muloco_k4_stat4_emb8")
QUICK_METHODS = ("dp_adamw", "dp_muon", "diloco_k1", "muloco_k1", "diloco_k4", "muloco_k4", "muloco_k4_stat4",
                 "muloco_k4_stat2ef")
# The paper's 150M column (arXiv 2505.23725) for the methods it reports; K=16 there, not K=4.
PAPER_150M = {"dp_adamw": 3.158, "dp_muon": 3.124, "muloco_k1": 3.120, "diloco_k1": 3.142}


@dataclass(frozen=True)
class Settings:
    steps: int = 300
    sync_interval: int = 30
    warmup: int = 20
    global_batch: int = 16  # sequences of the tiny preset's 128 tokens
    eval_batches: int = 4  # E: validation sequences = E * global_batch
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = METHOD_ORDER
    lr_grid_size: int = 3  # the first n of each LR_GRIDS entry, centred on the middle value
    outer_neighbours: bool = True
    run_timeout_s: int = 1800

    def lr_grid(self, optimizer: str) -> tuple[float, ...]:
        grid = LR_GRIDS[optimizer]
        start = (len(grid) - self.lr_grid_size) // 2
        return grid[start:start + self.lr_grid_size]


QUICK = Settings(steps=60, sync_interval=10, warmup=6, seeds=(0,), methods=QUICK_METHODS, lr_grid_size=2,
                 outer_neighbours=False, run_timeout_s=1800)


@dataclass(frozen=True)
class Method:
    name: str
    config: dict
    workers: int
    optimizer: str
    outer: tuple[float, float] | None  # the config's (outer lr, momentum); None for DP

    @classmethod
    def load(cls, name: str) -> "Method":
        path = CONFIG_DIR / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"unknown method {name!r}: no {path}")
        config = json.loads(path.read_text())
        muloco = config.get("muloco")
        return cls(name, config, muloco["workers"] if muloco else 1, config["optimizer"]["type"],
                   (muloco["outer_lr"], muloco["outer_momentum"]) if muloco else None)

    @property
    def compression(self) -> str:
        c = (self.config.get("muloco") or {}).get("compression", {"method": "none"})
        if c["method"] == "none":
            return "none"
        groups = f" (emb {c.get('embedding_bits', 32)}, 1-D {c.get('vector_bits', 32)})"
        return f"{c['method']} {c['bits']}-bit{groups}" + (" + EF" if c.get("error_feedback") else "")


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


@dataclass
class RunResult:
    spec: RunSpec
    final_val_loss: float
    val_curve: list[tuple[int, float]]  # (step, val loss)
    bytes_curve: list[tuple[int, float]]  # (step, cumulative bytes sent per worker)
    mean_cosine: float | None
    seconds: float
    bytes_per_worker: float = field(init=False)

    def __post_init__(self):
        self.bytes_per_worker = self.bytes_curve[-1][1] if self.bytes_curve else 0.0


# -- data -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Data:
    tokenizer: Path
    train: str
    valid: str


def prepare_data(work: Path) -> Data:
    """The shakespeare tokenizer (vocab 4096) and train/valid indexed datasets, built once."""
    data = Data(work / "data" / "tok.model", str(work / "data" / "train_text_document"),
                str(work / "data" / "valid_text_document"))
    (work / "data").mkdir(parents=True, exist_ok=True)
    if not data.tokenizer.exists():
        _check_call([sys.executable, "-m", "tokenizer.train", "--input", str(CORPUS / "train"), "--vocab-size", "4096",
                     "--output-prefix", str(data.tokenizer.with_suffix(""))])
    for split, prefix in (("train", data.train), ("valid", data.valid)):
        if not Path(prefix + ".idx").exists():
            _check_call([sys.executable, "tools/preprocess_data.py", "--input", str(CORPUS / split), "--output-prefix",
                         prefix.removesuffix("_text_document"), "--tokenizer-model", str(data.tokenizer),
                         "--workers", "2"])
    return data


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _check_call(command: list[str]) -> None:
    subprocess.run(command, cwd=REPO, env=_env(), check=True, stdout=subprocess.DEVNULL)


# -- runs -----------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:  # other launches share the machine: never the default port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(method: Method, spec: RunSpec, settings: Settings) -> dict:
    """The method's ds_config with this run's sync interval, warmup and outer lr."""
    config = json.loads(json.dumps(method.config))
    config["scheduler"]["params"]["warmup_iters"] = settings.warmup
    if "muloco" in config:
        config["muloco"]["sync_interval"] = settings.sync_interval
        config["muloco"]["outer_lr"] = spec.outer_lr
    return config


def launch(method: Method, spec: RunSpec, settings: Settings, data: Data, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a half-finished earlier attempt
    ds_config = run_dir / "ds_config.json"
    ds_config.write_text(json.dumps(run_config(method, spec, settings), indent=2))
    K = method.workers
    command = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(K), "--master_port",
               str(_free_port()), "trainer/pretrain.py", "--ds_config", str(ds_config), "--model", "tiny",
               "--data-path", data.train, "--valid-data-path", data.valid, "--tokenizer-model", str(data.tokenizer),
               "--train-iters", str(settings.steps), "--lr", str(spec.inner_lr),
               "--global-batch-size", str(settings.global_batch), "--micro-batch-size", str(settings.global_batch // K),
               "--seed", str(spec.seed), "--eval-interval", str(settings.sync_interval),
               "--eval-iters", str(settings.eval_batches * K),  # E*K batches of B/K: E*B sequences
               "--log-interval", str(settings.sync_interval), "--run-dir", str(run_dir)]
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=settings.run_timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks share this session
            proc.wait()
            code = f"timeout after {settings.run_timeout_s} s"
    if code != 0 or not (run_dir / "summary.json").exists():
        raise RuntimeError(f"run {spec.name} failed ({code}); see {run_dir / 'log.txt'}")


def read_result(spec: RunSpec, run_dir: Path, workers: int) -> RunResult:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    syncs = [r for r in records if "outer_step" in r and r.get("skipped") is None]
    sent, curve = 0.0, []
    for r in syncs:
        sent += r["bytes_sent_per_rank"]  # one rank per worker here (D = P = T = 1)
        curve.append((r["step"], sent))
    cosines = [r["pseudograd_cosine"] for r in syncs]
    # K = 1 "averages" over one worker: the cosine is 1 by construction, not a measurement.
    mean_cosine = statistics.fmean(cosines) if cosines and workers > 1 else None
    seconds = json.loads((run_dir / "timing.json").read_text())["seconds"]
    return RunResult(spec, val[-1][1], val, curve, mean_cosine, seconds)


def run(method: Method, spec: RunSpec, settings: Settings, data: Data, work: Path) -> RunResult:
    run_dir = work / "runs" / spec.name
    if not (run_dir / "timing.json").exists():
        start = time.time()
        print(f"run {spec.name} (K={method.workers})", flush=True)
        launch(method, spec, settings, data, run_dir)
        (run_dir / "timing.json").write_text(json.dumps({"seconds": time.time() - start}))
    return read_result(spec, run_dir, method.workers)


def sweep(method: Method, settings: Settings, data: Data, work: Path) -> list[RunResult]:
    """Tune the inner lr (then the outer-lr neighbour) on the first seed; rerun the best with the rest."""
    first = settings.seeds[0]
    outer = method.outer[0] if method.outer else None
    results = [run(method, RunSpec(method.name, lr, outer, first), settings, data, work)
               for lr in settings.lr_grid(method.optimizer)]
    best = min(results, key=lambda r: r.final_val_loss).spec
    if settings.outer_neighbours and outer is not None:
        results.append(run(method, replace(best, outer_lr=OUTER_LR_NEIGHBOUR[outer]), settings, data, work))
        best = min(results, key=lambda r: r.final_val_loss).spec
    results += [run(method, replace(best, seed=seed), settings, data, work) for seed in settings.seeds[1:]]
    return results


# -- report ---------------------------------------------------------------------------------------

@dataclass
class Summary:
    method: str
    workers: int
    inner: str
    compression: str
    inner_lr: float
    outer: str
    val_loss_mean: float
    val_loss_std: float
    seeds: int
    mb_sent_per_worker: float
    mean_pseudograd_cosine: float | None
    paper_150m: float | None
    best: list[RunResult] = field(repr=False)


def summarize(method: Method, results: list[RunResult]) -> Summary:
    first = results[0].spec.seed
    best = min((r for r in results if r.spec.seed == first), key=lambda r: r.final_val_loss).spec
    runs = [r for r in results if replace(r.spec, seed=first) == best]
    losses = [r.final_val_loss for r in runs]
    cosines = [r.mean_cosine for r in runs if r.mean_cosine is not None]
    return Summary(method.name, method.workers, method.optimizer, method.compression, best.inner_lr,
                   "-" if best.outer_lr is None else f"{best.outer_lr:g}/{method.outer[1]:g}",
                   statistics.fmean(losses), statistics.stdev(losses) if len(losses) > 1 else 0.0, len(losses),
                   statistics.fmean(r.bytes_per_worker for r in runs) / 1e6,
                   statistics.fmean(cosines) if cosines else None, PAPER_150M.get(method.name), runs)


def write_tables(summaries: list[Summary], all_results: list[RunResult], out: Path) -> str:
    with open(out / "runs.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "method", "inner_lr", "outer_lr", "seed", "final_val_loss", "mb_sent_per_worker",
                    "mean_pseudograd_cosine", "seconds"])
        for r in all_results:
            w.writerow([r.spec.name, r.spec.method, r.spec.inner_lr, r.spec.outer_lr, r.spec.seed,
                        f"{r.final_val_loss:.4f}", f"{r.bytes_per_worker / 1e6:.3f}",
                        "" if r.mean_cosine is None else f"{r.mean_cosine:.4f}", f"{r.seconds:.0f}"])
    columns = ["method", "workers", "inner", "compression", "inner_lr", "outer", "val_loss_mean", "val_loss_std",
               "seeds", "mb_sent_per_worker", "mean_pseudograd_cosine", "paper_150m"]
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for s in summaries:
            w.writerow([getattr(s, c) for c in columns])
    lines = ["| method | K | inner | compression | inner lr | outer lr/mom | final val loss (mean ± std, n) | "
             "MB sent per worker | mean pseudograd cosine | paper 150M |", "|" + "---|" * 10]
    for s in sorted(summaries, key=lambda s: s.val_loss_mean):
        cos = "-" if s.mean_pseudograd_cosine is None else f"{s.mean_pseudograd_cosine:.3f}"
        paper = "-" if s.paper_150m is None else f"{s.paper_150m:.3f}"
        lines.append(f"| {s.method} | {s.workers} | {s.inner} | {s.compression} | {s.inner_lr:g} | {s.outer} | "
                     f"{s.val_loss_mean:.4f} ± {s.val_loss_std:.4f} ({s.seeds}) | {s.mb_sent_per_worker:.2f} | "
                     f"{cos} | {paper} |")
    table = "\n".join(lines)
    (out / "table.md").write_text(table + "\n")
    return table


def plot(summaries: list[Summary], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in summaries:
        r = s.best[0]
        ax.plot(*zip(*r.val_curve), marker="o", ms=3, label=f"{s.method} (lr {s.inner_lr:g})",
                linestyle="--" if s.inner == "adamw" else "-")
    ax.set(xlabel="inner step", ylabel="validation loss", title="validation loss vs steps (first seed)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "val_loss_vs_steps.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in summaries:
        r = s.best[0]
        if s.workers == 1 or not r.bytes_curve:
            continue  # nothing crosses workers
        sent = dict(r.bytes_curve)
        points = [(sent[step] / 1e6, loss) for step, loss in r.val_curve if step in sent]
        ax.plot(*zip(*points), marker="o", ms=3, label=s.method, linestyle="--" if s.inner == "adamw" else "-")
    ax.set(xlabel="MB sent per worker (cumulative)", ylabel="validation loss", xscale="log",
           title="validation loss vs bytes sent across workers (K > 1, first seed)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "val_loss_vs_bytes.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=REPO / "runs" / "compare")
    p.add_argument("--quick", action="store_true", help=f"{QUICK.steps} steps, H={QUICK.sync_interval}, "
                   f"{QUICK.lr_grid_size} lrs, one seed, no outer-lr neighbour, {len(QUICK_METHODS)} methods")
    p.add_argument("--steps", type=int)
    p.add_argument("--sync-interval", type=int)
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--methods", nargs="+", choices=METHOD_ORDER)
    args = p.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    overrides = {"steps": args.steps, "sync_interval": args.sync_interval,
                 "seeds": tuple(args.seeds) if args.seeds else None,
                 "methods": tuple(args.methods) if args.methods else None}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    if settings.steps % settings.sync_interval:
        raise SystemExit(f"--steps {settings.steps} must be a multiple of the sync interval {settings.sync_interval}")
    work = args.work_dir / f"steps{settings.steps}_h{settings.sync_interval}"
    args.out.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args.work_dir)
    summaries, all_results, failures = [], [], []
    start = time.time()
    for name in settings.methods:
        method = Method.load(name)
        try:
            results = sweep(method, settings, data, work)
        except RuntimeError as err:
            failures.append(str(err))
            print(err, file=sys.stderr, flush=True)
            continue
        all_results += results
        summaries.append(summarize(method, results))
    table = write_tables(summaries, all_results, args.out)
    plot(summaries, args.out)
    (args.out / "settings.json").write_text(json.dumps(
        {**asdict(settings), "lr_grids": LR_GRIDS, "outer_lr_neighbour": OUTER_LR_NEIGHBOUR,
         "wall_clock_s": round(time.time() - start), "failures": failures}, indent=2))
    print(table)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
