"""Preprocessing throughput with 1 and 2 workers on one big file and on many files, and how well the
second worker scales.

python benchmarks/preprocess_throughput.py [--mb 44] [--tokenizer-model M] [--cases big_jsonl big_zstd many_files]

The corpus is generated from the repository's sample corpus: its documents, shuffled with a fixed seed and
repeated until the text reaches --mb megabytes, written as one uncompressed JSONL (big_jsonl: workers read
byte ranges), the same as one zstd JSONL (big_zstd: decompressed once, blocks handed to the workers), and
the same cut into 32 zstd shards (many_files). Without --tokenizer-model a small SentencePiece model is
trained on the sample corpus first. tokens/s is the tool's own: from the first chunk handed out to the last
one done (imports, tokenizer loading and the final merge excluded). The 1-minute load average is printed
next to every number: the ratio means "scaling" only when the machine has two free cores. The 2-worker
output is checked byte-for-byte against the 1-worker output. The last line printed is a JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataprep.shards import resolve_inputs
from tokenizer.train import TokenizerTrainingConfig, train_tokenizer
from tools.preprocess_data import PreprocessConfig, run_preprocess

SAMPLE_CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "shakespeare"
MANY_FILES = 32
CASES = ("big_jsonl", "big_zstd", "many_files")


def sample_lines() -> list[bytes]:
    """Every JSON line (one document each) of the sample corpus."""
    lines = []
    for shard in resolve_inputs([str(SAMPLE_CORPUS)]):
        text = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes())
        lines += [line + b"\n" for line in text.split(b"\n") if line.strip()]
    return lines


def build_corpus(work_dir: Path, megabytes: float) -> dict[str, str]:
    lines, rng = sample_lines(), random.Random(0)
    chosen: list[bytes] = []
    size = 0
    while size < megabytes * 1e6:
        rng.shuffle(lines)
        for line in lines:
            chosen.append(line)
            size += len(line)
            if size >= megabytes * 1e6:
                break
    text = b"".join(chosen)
    (work_dir / "big").mkdir()
    (work_dir / "big" / "corpus.jsonl").write_bytes(text)
    (work_dir / "big_zstd").mkdir()
    (work_dir / "big_zstd" / "corpus.jsonl.zstd").write_bytes(zstandard.ZstdCompressor().compress(text))
    many = work_dir / "many"
    many.mkdir()
    per_file = -(-len(chosen) // MANY_FILES)
    for index in range(MANY_FILES):
        part = b"".join(chosen[index * per_file:(index + 1) * per_file])
        (many / f"part-{index:05d}.jsonl.zstd").write_bytes(zstandard.ZstdCompressor().compress(part))
    return {"big_jsonl": str(work_dir / "big" / "corpus.jsonl"), "big_zstd": str(work_dir / "big_zstd"),
            "many_files": str(many), "megabytes": round(len(text) / 1e6, 1)}


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the pool's workers, once the run has ended)."""
    return sum(usage.ru_utime + usage.ru_stime for usage in
               (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def measure(case: str, inputs: str, tokenizer_model: Path, workers: int, work_dir: Path) -> dict:
    load_before = os.getloadavg()[0]
    cpu_before = cpu_seconds()
    config = PreprocessConfig(inputs=(inputs,), output_prefix=str(work_dir / f"{case}_w{workers}"),
                              tokenizer_model=tokenizer_model, workers=workers)
    summary = run_preprocess(config)
    cpu = cpu_seconds() - cpu_before
    return {
        "case": case,
        "workers": workers,
        "chunks": summary.chunks,
        "tokens": summary.tokens,
        "tokenize_seconds": round(summary.tokenize_seconds, 3),
        "total_seconds": round(summary.seconds, 3),
        "tokens_per_s": round(summary.tokens_per_second),
        "mb_per_s": round(summary.megabytes_per_second, 3),
        # Tokens per CPU-second of all processes: what the work costs, whatever the load; equal for 1 and 2
        # workers means the split adds no work, so on two free cores the wall-clock ratio approaches 2.
        "tokens_per_cpu_s": round(summary.tokens / cpu),
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "prefix": config.dataset_prefix,
    }


def identical(a: str, b: str) -> bool:
    return all(Path(a + suffix).read_bytes() == Path(b + suffix).read_bytes() for suffix in (".bin", ".idx"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=44.0, help="corpus size in MB of JSONL (default %(default)s)")
    parser.add_argument("--tokenizer-model", type=Path, help="default: train a 4096-piece model on the sample corpus")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = Path(scratch)
        model = args.tokenizer_model or train_tokenizer(TokenizerTrainingConfig(
            inputs=(str(SAMPLE_CORPUS / "train"),), output_prefix=work_dir / "tokenizer", vocab_size=4096,
            max_chars=1_000_000)).model_path
        corpus = build_corpus(work_dir, args.mb)
        runs, ratios = [], []
        for case in args.cases:
            one, two = (measure(case, corpus[case], model, workers, work_dir) for workers in (1, 2))
            ratios.append({"case": case, "ratio_2_over_1": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
                           "cpu_cost_ratio_2_over_1": round(one["tokens_per_cpu_s"] / two["tokens_per_cpu_s"], 3),
                           "identical_output": identical(one.pop("prefix"), two.pop("prefix"))})
            runs += [one, two]
    print(f"corpus: {corpus['megabytes']} MB of JSONL; machine: {os.cpu_count()} cores")
    for result in runs:
        print(f"{result['case']:>10} workers={result['workers']}: {result['tokens_per_s']} tokens/s "
              f"({result['mb_per_s']} MB/s, {result['chunks']} chunks, {result['tokenize_seconds']} s, "
              f"{result['tokens_per_cpu_s']} tokens per CPU-second), "
              f"load {result['load_1min_before']} -> {result['load_1min_after']}")
    for ratio in ratios:
        print(f"{ratio['case']:>10} 2-worker/1-worker: {ratio['ratio_2_over_1']:.2f}x tokens/s, "
              f"{ratio['cpu_cost_ratio_2_over_1']:.2f}x CPU per token, identical .bin/.idx: {ratio['identical_output']}")
    print(json.dumps({"benchmark": "preprocess_throughput", "megabytes": corpus["megabytes"],
                      "cpu_count": os.cpu_count(), "runs": runs, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
