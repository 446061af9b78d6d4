"""Preprocessing throughput: the whole tool against the tokenizer's own limit, and 1 vs 2 processes.

python benchmarks/preprocess_throughput.py [--mb 44] [--limit-mb 8] [--repeats 3] [--tokenizer-model M]
    [--tokenizers sentencepiece huggingface] [--cases big_jsonl big_zstd many_files]

The corpus is generated from the repository's sample corpus: its documents, shuffled with a fixed seed and
repeated until the text reaches --mb megabytes, written as one uncompressed JSONL (big_jsonl: the processes read
byte ranges), the same as one zstd JSONL (big_zstd: decompressed once, blocks handed to the processes),
and the same cut into 32 zstd files (many_files). The tokenizers are trained on the sample corpus first: a
4096-piece SentencePiece BPE (the scaling cases use it; --tokenizer-model gives another SentencePiece model
instead) and a 4096-token byte-level BPE tokenizer.json.

Tokenizer limit (per tokenizer, on the first --limit-mb of the text as one JSONL file): the tool with one
process against the tokenizer library's own batch call on one thread (SentencePiece `encode(list,
num_threads=1)`, `tokenizers` `encode_batch_fast` without parallelism) over the same documents, already
decoded from JSON and held in memory, in batches of the tool's size. The two alternate --repeats times;
the ratios are of the medians, by wall clock and by CPU time (all processes): the CPU-time ratio is the
one that holds on a busy machine, where a run's wall clock depends on what else got the cores. tokens/s of the tool is its own: from the first chunk handed out to the last one done
(imports, tokenizer loading and the final merge excluded); the tool's tokens include one end-of-document
token per document, which the library's call does not produce, so the ratio counts the library's tokens.

Scaling: each case with 1 and 2 processes (--processes); the 1-minute load average is printed next to every
number: the ratio means "scaling" only when the machine has two free cores. The 2-process output is checked
byte-for-byte against the 1-process output. The last line printed is a JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: the limit is per thread

import zstandard


from dataprep.input_files import resolve_inputs
from tokenizer.train import TokenizerTrainingConfig, train_tokenizer
from tools.preprocessing.config import PreprocessConfig
from tools.preprocessing.run import run_preprocess
from tools.preprocessing.tokenize_worker import ENCODE_BATCH_DOCUMENTS

SAMPLE_CORPUS = Path(__file__).resolve().parents[1] / "corpus" / "shakespeare"
MANY_FILES = 32
CASES = ("big_jsonl", "big_zstd", "many_files")
TOKENIZERS = ("sentencepiece", "huggingface")
VOCAB_SIZE = 4096


def sample_lines() -> list[bytes]:
    """Every JSON line (one document each) of the sample corpus."""
    lines = []
    for path in resolve_inputs([str(SAMPLE_CORPUS)]):
        text = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
        lines += [line + b"\n" for line in text.split(b"\n") if line.strip()]
    return lines


def corpus_lines(megabytes: float) -> list[bytes]:
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
    return chosen


def build_corpus(work_dir: Path, chosen: list[bytes]) -> dict[str, str]:
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


def sentencepiece_model(work_dir: Path) -> Path:
    """A VOCAB_SIZE-piece SentencePiece BPE trained on the sample corpus (benchmarks/tool_startup.py uses it too)."""
    return train_tokenizer(TokenizerTrainingConfig(
        inputs=(str(SAMPLE_CORPUS / "train"),), output_prefix=work_dir / "tokenizer", vocab_size=VOCAB_SIZE,
        max_chars=1_000_000)).model_path


def train_tokenizers(work_dir: Path, sentencepiece_model_: Path | None) -> dict[str, Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    models_ = {"sentencepiece": sentencepiece_model_ or sentencepiece_model(work_dir)}
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|end_of_text|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator((json.loads(line)["text"] for line in sample_lines()), trainer)
    (work_dir / "hf").mkdir()
    hf.save(str(work_dir / "hf" / "tokenizer.json"))
    models_["huggingface"] = work_dir / "hf" / "tokenizer.json"
    return models_


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the pool's processes, once the run has ended)."""
    return sum(usage.ru_utime + usage.ru_stime for usage in
               (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))


def measure(name: str, inputs: str, tokenizer_model: Path, processes: int, work_dir: Path) -> dict:
    load_before = os.getloadavg()[0]
    cpu_before = cpu_seconds()
    config = PreprocessConfig(inputs=(inputs,), output_prefix=str(work_dir / name),
                              tokenizer_model=tokenizer_model, processes=processes)
    summary = run_preprocess(config)
    cpu = cpu_seconds() - cpu_before
    return {
        "processes": processes,
        "chunks": summary.chunks,
        "documents": summary.documents,
        "tokens": summary.tokens,
        "tokenize_seconds": round(summary.tokenize_seconds, 3),
        "total_seconds": round(summary.seconds, 3),
        "tokens_per_s": round(summary.tokens_per_second),
        "mb_per_s": round(summary.megabytes_per_second, 3),
        # Tokens per CPU-second of all processes: what the work costs, whatever the load; equal for 1 and 2
        # processes means the split adds no work, so on two free cores the wall-clock ratio approaches 2.
        "tokens_per_cpu_s": round(summary.tokens / cpu),
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "prefix": config.dataset_prefix,
    }


def native_batch_encoder(kind: str, model: Path):
    """The library's own batch call on one thread, returning the ids of each text."""
    if kind == "sentencepiece":
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(model_file=str(model), num_threads=1)
        return lambda texts: processor.encode(texts, out_type=int, num_threads=1)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model))
    tokenizer.encode_special_tokens = True
    return lambda texts: [encoding.ids for encoding in tokenizer.encode_batch_fast(texts, add_special_tokens=False)]


def measure_native(encode, texts: list[str]) -> dict:
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = 0
    for start in range(0, len(texts), ENCODE_BATCH_DOCUMENTS):
        tokens += sum(map(len, encode(texts[start:start + ENCODE_BATCH_DOCUMENTS])))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"tokens": tokens, "tokens_per_s": round(tokens / wall), "tokens_per_cpu_s": round(tokens / cpu)}


def tokenizer_limit(kind: str, model: Path, corpus_file: Path, work_dir: Path, repeats: int) -> dict:
    texts = [json.loads(line)["text"] for line in corpus_file.read_bytes().splitlines()]
    texts = [text for text in texts if text]
    encode = native_batch_encoder(kind, model)
    native, tool = [], []
    for repeat in range(repeats):
        native.append(measure_native(encode, texts))
        run = measure(f"limit_{kind}_{repeat}", str(corpus_file), model, 1, work_dir)
        # The same text in the tool's count, without its end-of-document tokens.
        run["library_tokens"] = run["tokens"] - run["documents"]
        run["library_tokens_per_s"] = round(run["library_tokens"] * run["tokens_per_s"] / run["tokens"])
        run["library_tokens_per_cpu_s"] = round(run["library_tokens"] * run["tokens_per_cpu_s"] / run["tokens"])
        tool.append(run)
    assert all(run["library_tokens"] == native[0]["tokens"] for run in tool), "the tool and the library disagree"
    median = lambda runs, key: statistics.median(run[key] for run in runs)  # noqa: E731
    return {
        "tokenizer": kind, "documents": len(texts), "tokens": native[0]["tokens"],
        "native_tokens_per_s": [run["tokens_per_s"] for run in native],
        "tool_tokens_per_s": [run["library_tokens_per_s"] for run in tool],
        "ratio_wall": round(median(tool, "library_tokens_per_s") / median(native, "tokens_per_s"), 3),
        "ratio_cpu": round(median(tool, "library_tokens_per_cpu_s") / median(native, "tokens_per_cpu_s"), 3),
        "load_1min": [run["load_1min_before"] for run in tool],
    }


def identical(a: str, b: str) -> bool:
    return all(Path(a + suffix).read_bytes() == Path(b + suffix).read_bytes() for suffix in (".bin", ".idx"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=44.0, help="corpus size in MB of JSONL (default %(default)s)")
    parser.add_argument("--limit-mb", type=float, default=8.0,
                        help="MB of it for the tokenizer-limit runs (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="alternations of the limit runs (default %(default)s)")
    parser.add_argument("--tokenizer-model", type=Path, help="a SentencePiece model (default: train a 4096-piece one)")
    parser.add_argument("--tokenizers", nargs="*", choices=TOKENIZERS, default=list(TOKENIZERS))
    parser.add_argument("--cases", nargs="*", choices=CASES, default=list(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = Path(scratch)
        models = train_tokenizers(work_dir, args.tokenizer_model)
        lines = corpus_lines(args.mb)
        corpus = build_corpus(work_dir, lines)
        limit_file = work_dir / "limit.jsonl"
        limit_file.write_bytes(b"".join(corpus_lines(args.limit_mb)))
        limits = [tokenizer_limit(kind, models[kind], limit_file, work_dir, args.repeats) for kind in args.tokenizers]
        runs, ratios = [], []
        for case in args.cases:
            one, two = ({"case": case, **measure(f"{case}_p{processes}", corpus[case], models["sentencepiece"],
                                                 processes, work_dir)} for processes in (1, 2))
            ratios.append({"case": case, "ratio_2_over_1": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
                           "cpu_cost_ratio_2_over_1": round(one["tokens_per_cpu_s"] / two["tokens_per_cpu_s"], 3),
                           "identical_output": identical(one.pop("prefix"), two.pop("prefix"))})
            runs += [one, two]
    print(f"corpus: {corpus['megabytes']} MB of JSONL ({args.limit_mb} MB for the limit); machine: "
          f"{os.cpu_count()} cores")
    for limit in limits:
        print(f"{limit['tokenizer']:>13} limit: tool with 1 process / native batch encode on 1 thread: "
              f"{limit['ratio_wall']:.3f}x tokens/s (medians), "
              f"{limit['ratio_cpu']:.3f}x tokens per CPU-second "
              f"(native {limit['native_tokens_per_s']}, tool {limit['tool_tokens_per_s']} tokens/s; "
              f"load {limit['load_1min']})")
    for result in runs:
        print(f"{result['case']:>13} processes={result['processes']}: {result['tokens_per_s']} tokens/s "
              f"({result['mb_per_s']} MB/s, {result['chunks']} chunks, {result['tokenize_seconds']} s, "
              f"{result['tokens_per_cpu_s']} tokens per CPU-second), "
              f"load {result['load_1min_before']} -> {result['load_1min_after']}")
    for ratio in ratios:
        print(f"{ratio['case']:>13} 2-process/1-process: {ratio['ratio_2_over_1']:.2f}x tokens/s, "
              f"{ratio['cpu_cost_ratio_2_over_1']:.2f}x CPU per token, identical .bin/.idx: {ratio['identical_output']}")
    print(json.dumps({"benchmark": "preprocess_throughput", "megabytes": corpus["megabytes"],
                      "limit_megabytes": args.limit_mb, "cpu_count": os.cpu_count(), "tokenizer_limit": limits,
                      "runs": runs, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
