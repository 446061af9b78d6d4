"""Checkpoint save and load time and peak memory (RSS) on CPU, single process, for the tiny and
150m presets, and the Hugging Face export time. Each preset trains one short step (sequence length
128, one sequence: the checkpoint's size does not depend on them), then saves and resumes again
under measurement.

python benchmarks/checkpoint_io.py [--presets tiny 150m] [--out DIR]

Peak RSS is the process's high-water mark above the RSS before the phase (Linux clear_refs).
The last line printed is JSON.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

from trainer.training import Trainer
from tools.trainer_runs import TINY_VOCAB, init_distributed, run_trainer, tiny_flags


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def measured(fn):
    """(result, seconds, peak RSS above the starting RSS in MiB)."""
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    return result, seconds, max(0, _status_kib("VmHWM") - before) / 1024


def _dir_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2 ** 20


# The paper's parameter counts include a ~128k vocabulary (150m: 20M in the blocks, 131M in the
# untied embedding and head); the Markov data's ids stay below TINY_VOCAB either way.
VOCAB = {"tiny": TINY_VOCAB, "150m": 128_000}


class MeasuredTrainer(Trainer):
    """Trains as usual (its end-of-run checkpoint is written by the real hook), then saves and
    resumes once more under measurement."""

    results: dict = {}

    def train(self) -> dict:
        from trainer.checkpoint import Checkpointer
        from trainer.data import tokenizer_info
        from trainer.model.builder import canonical_names, padded_vocab_size

        summary = super().train()
        vocab = tokenizer_info(self.config.data).vocab_size
        checkpointer = Checkpointer(self.config, self.topology, self, canonical_names(self.model), vocab,
                                    padded_vocab_size(vocab, self.topology.sizes.tensor))
        _, save_s, save_mib = measured(lambda: checkpointer.save(self.step))
        _, load_s, load_mib = measured(lambda: checkpointer.resume(self.config.save))
        MeasuredTrainer.results = {"save_s": save_s, "save_peak_rss_mib": save_mib, "load_s": load_s,
                                   "load_peak_rss_mib": load_mib}
        return summary


def bench_preset(preset: str, work: Path, data_prefix: str) -> dict:
    from tools.convert_checkpoint.export import export
    from tools.convert_checkpoint.merge import WeightSource
    from trainer.checkpoint import CheckpointReader

    ckpt = work / f"ckpt_{preset}"
    flags = tiny_flags(data_prefix, work / f"run_{preset}", "muon", "--seq-length", "128", "--micro-batch-size", "1",
                       "--train-iters", "1", "--eval-interval", "0", "--save", str(ckpt))
    flags[flags.index("tiny")] = preset
    flags[flags.index("--vocab-size") + 1] = str(VOCAB.get(preset, 128_000))
    run_trainer(flags, MeasuredTrainer)
    row = {"preset": preset, "checkpoint_mib": _dir_mib(ckpt / "iter_0000001"), **MeasuredTrainer.results}
    result, row["export_s"], row["export_peak_rss_mib"] = measured(
        lambda: export(reader := CheckpointReader(ckpt), work / f"hf_{preset}", WeightSource.of(reader, None)))
    row["export_mib"] = result.total_bytes / 2 ** 20
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["tiny", "150m"])
    p.add_argument("--out", default=None, help="work folder (default: a temporary one, removed afterwards)")
    args = p.parse_args(argv)
    from tools.synthetic_data import write_markov_dataset

    work = Path(args.out or tempfile.mkdtemp(prefix="checkpoint_io_"))
    work.mkdir(parents=True, exist_ok=True)
    init_distributed()
    data = write_markov_dataset(str(work / "markov"), vocab_size=TINY_VOCAB)
    rows = [bench_preset(preset, work, data) for preset in args.presets]
    for r in rows:
        print(f"{r['preset']:>5}: checkpoint {r['checkpoint_mib']:.0f} MiB | save {r['save_s']:.2f}s "
              f"(+{r['save_peak_rss_mib']:.0f} MiB RSS, {r['checkpoint_mib'] / r['save_s']:.0f} MiB/s) | "
              f"load {r['load_s']:.2f}s (+{r['load_peak_rss_mib']:.0f} MiB RSS) | export {r['export_s']:.2f}s "
              f"(+{r['export_peak_rss_mib']:.0f} MiB RSS, {r['export_mib']:.0f} MiB of safetensors)")
    if not args.out:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"benchmark": "checkpoint_io", "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
