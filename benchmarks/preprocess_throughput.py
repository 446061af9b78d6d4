"""Preprocessing throughput with 1 and 2 workers, and how well the second worker scales.

python benchmarks/preprocess_throughput.py [--input SHARDS ...] [--tokenizer-model M]

Without --tokenizer-model a small tokenizer is trained on the input first. The last line printed
is a JSON object with the numbers, for scripts.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenizer.train import TokenizerTrainingConfig, train_tokenizer  # noqa: E402
from tools.preprocess_data import PreprocessConfig, run_preprocess  # noqa: E402

SAMPLE_CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "shakespeare" / "train"


def measure(inputs: tuple[str, ...], tokenizer_model: Path, workers: int, work_dir: Path) -> dict:
    config = PreprocessConfig(inputs=inputs, output_prefix=str(work_dir / f"workers{workers}"),
                              tokenizer_model=tokenizer_model, workers=workers)
    summary = run_preprocess(config)
    return {
        "workers": workers,
        "seconds": round(summary.seconds, 3),
        "tokens": summary.tokens,
        "tokens_per_s": round(summary.tokens_per_second),
        "tokens_per_s_per_worker": round(summary.tokens_per_second / workers),
        "mb_per_s": round(summary.megabytes_per_second, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", default=[str(SAMPLE_CORPUS)])
    parser.add_argument("--tokenizer-model", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = Path(scratch)
        model = args.tokenizer_model or train_tokenizer(TokenizerTrainingConfig(
            inputs=tuple(args.input), output_prefix=work_dir / "tokenizer", vocab_size=4096, max_chars=1_000_000,
        )).model_path
        measure(tuple(args.input), model, 1, work_dir)  # warm-up: page cache, lazy imports
        results = [measure(tuple(args.input), model, workers, work_dir) for workers in (1, 2)]
    for result in results:
        print(f"workers={result['workers']}: {result['tokens_per_s']} tokens/s total, "
              f"{result['tokens_per_s_per_worker']} tokens/s per worker, {result['mb_per_s']} MB/s")
    ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"2-worker/1-worker throughput ratio: {ratio:.2f}")
    print(json.dumps({"benchmark": "preprocess_throughput", "results": results, "ratio_2_over_1": round(ratio, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
