"""Muon against AdamW as the inner optimizer, each at its best learning rate: tiny preset, one CPU
process, synthetic Markov data, the same steps, batch and schedule (warm-up and cosine decay from the
ds configs); Muon's AdamW part (embeddings, head, 1-D parameters) uses the ds config's adamw_lr_factor.

python benchmarks/muon_vs_adamw.py [--steps 200] [--adamw-lrs 1e-3 3e-3 1e-2] [--muon-lrs 0.01 0.02 0.04]

Reports the final validation loss of every run and the best of each optimizer. The last line printed
is a JSON object with the numbers, for scripts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


from tools.synthetic_data import write_markov_dataset
from tools.trainer_runs import TINY_VOCAB, init_distributed, run_trainer, tiny_flags

EVAL_ITERS = 16  # 64 validation sequences of 128 tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--adamw-lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--muon-lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    args = parser.parse_args()
    init_distributed()
    grid = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    val_loss: dict[str, dict[str, float]] = {"adamw": {}, "muon": {}}
    with tempfile.TemporaryDirectory() as tmp:
        # 2000 documents (~450k tokens): 200 steps of 4 x 128 tokens see each training token about once.
        data = write_markov_dataset(str(Path(tmp) / "markov"), vocab_size=TINY_VOCAB, num_docs=2000)
        for optimizer, lrs in grid.items():
            for lr in lrs:
                summary = run_trainer(tiny_flags(
                    data, Path(tmp) / f"{optimizer}_{lr}", optimizer, "--lr", str(lr), "--train-iters", str(args.steps),
                    "--eval-interval", str(args.steps), "--eval-iters", str(EVAL_ITERS), "--log-interval", "50"))
                val_loss[optimizer][str(lr)] = round(summary["val_loss"], 4)
                print(f"{optimizer} lr {lr}: final validation loss {summary['val_loss']:.4f}", flush=True)
    best = {opt: min(losses.items(), key=lambda kv: kv[1]) for opt, losses in val_loss.items()}
    result = {"steps": args.steps, "val_loss": val_loss,
              "best": {opt: {"lr": float(lr), "val_loss": loss} for opt, (lr, loss) in best.items()},
              "muon_minus_adamw": round(best["muon"][1] - best["adamw"][1], 4)}
    print(f"best AdamW: lr {best['adamw'][0]} -> {best['adamw'][1]}; best Muon: lr {best['muon'][0]} -> "
          f"{best['muon'][1]}; Muon - AdamW = {result['muon_minus_adamw']:+.4f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
