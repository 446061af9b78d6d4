"""Small learnable token datasets in Megatron's indexed format, written with megatron-core's own
IndexedDatasetBuilder: each document walks a fixed random successor table with some noise, so a
model can learn it and the loss goes down within a few dozen steps (tests, benchmarks, demos):

    python tools/synthetic_data.py PREFIX [--vocab-size 1000] [--num-docs 400]

And blends of thousands of tiny numbered datasets (`write_numbered_datasets`), for what a blend's size costs.
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder


def write_markov_dataset(prefix: str, vocab_size: int = 1000, num_docs: int = 400, doc_len: int = 300,
                         noise: float = 0.1, seed: int = 0, eod: int = 0) -> str:
    rng = np.random.default_rng(seed)
    successor = rng.integers(1, vocab_size, size=vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(num_docs):
        length = int(rng.integers(doc_len // 2, doc_len))
        doc = np.empty(length + 1, dtype=np.int64)
        doc[0] = rng.integers(1, vocab_size)
        for i in range(1, length):
            doc[i] = rng.integers(1, vocab_size) if rng.random() < noise else successor[doc[i - 1]]
        doc[length] = eod
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def write_numbered_datasets(folder: Path, count: int, documents: int = 2, doc_tokens: int = 20,
                            vocab_size: int = 65535) -> list[str]:
    """`count` datasets P00000, P00001, ... in `folder`, each of `documents` documents of `doc_tokens` tokens,
    every token of dataset i being 1 + i % (vocab_size - 1): which dataset a sample came from can be read off
    its tokens. Megatron's builder writes the first; the others are its .idx copied (they all have the same
    lengths) beside a .bin of their own number, so thousands take seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    first = str(folder / "P00000")
    builder = IndexedDatasetBuilder(f"{first}.bin", dtype=np.uint16)
    for _ in range(documents):
        builder.add_document(torch.ones(doc_tokens, dtype=torch.int64), [doc_tokens])
    builder.finalize(f"{first}.idx")
    prefixes = [str(folder / f"P{index:05d}") for index in range(count)]
    for index, prefix in enumerate(prefixes):
        if index:
            shutil.copyfile(f"{first}.idx", f"{prefix}.idx")
        np.full(documents * doc_tokens, 1 + index % (vocab_size - 1), np.uint16).tofile(f"{prefix}.bin")
    return prefixes


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="write a learnable synthetic token dataset (PREFIX.bin, PREFIX.idx)")
    p.add_argument("prefix")
    p.add_argument("--vocab-size", type=int, default=1000)
    p.add_argument("--num-docs", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(write_markov_dataset(args.prefix, args.vocab_size, args.num_docs, seed=args.seed))


if __name__ == "__main__":
    main()
