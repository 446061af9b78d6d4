"""Build a small real-text demo corpus, in Nemotron-CC form, from the Python standard library docs.

python -m tools.build_demo_corpus --output DIR [--max-mb N] [--train-files N]

Every machine that runs the project has the standard library, so this corpus needs no download:
one document per importable stdlib module (and first-level submodule), holding the module's
docstring and those of its public classes, methods and functions. DIR/train/ and DIR/valid/ get
*.jsonl.zstd files with Nemotron-CC's fields. Validation is a fixed ~10% of modules chosen by a
hash of the module name, so the split does not move when a module is missing on some machine.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import inspect
import io
import json
import pkgutil
import re
import sys
import textwrap
import uuid
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Iterator, Sequence

import zstandard

# Importing these opens a browser, prints, starts a GUI or runs a program.
SKIPPED_MODULES = frozenset({
    "antigravity", "this", "__hello__", "__phello__", "tkinter", "turtle", "turtledemo", "idlelib",
    "test", "tests", "__main__", "ensurepip", "venv", "lib2to3", "pydoc_data",
})
VALID_PERCENT = 10
FILE_NAME = "CC-MAIN-pystdlib-part-{:05d}.jsonl.zstd"
WARC_DATE = "2024-01-01T00:00:00Z"  # fixed: the corpus must be byte-for-byte reproducible
_MEMORY_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class DemoCorpusConfig:
    output: Path
    max_mb: float = 4.0
    train_files: int = 4


def stdlib_module_names() -> list[str]:
    """Top-level stdlib modules and their first-level public submodules, sorted."""
    names = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIPPED_MODULES:
            continue
        module = _import_quietly(name)
        if module is None:
            continue
        names.append(name)
        for submodule in pkgutil.iter_modules(getattr(module, "__path__", [])):
            if not submodule.name.startswith("_") and submodule.name not in SKIPPED_MODULES:
                names.append(f"{name}.{submodule.name}")
    return names


def _import_quietly(name: str) -> ModuleType | None:
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # deprecated modules still have good docs
            return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - platform-specific or broken modules are simply left out
        return None


def module_document(module: ModuleType) -> str:
    """The module docstring followed by the docstrings of its public API, in name order."""
    sections = [f"Module {module.__name__}\n\n{inspect.getdoc(module) or ''}".strip()]
    for name, member in sorted(vars(module).items()):
        if name.startswith("_") or getattr(member, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(member):
            sections.append(_api_section("class", name, member))
            for method_name, method in sorted(vars(member).items()):
                if not method_name.startswith("_") and callable(method):
                    sections.append(_api_section("method", f"{name}.{method_name}", method))
        elif inspect.isfunction(member) or inspect.isbuiltin(member):
            sections.append(_api_section("function", name, member))
    text = "\n\n".join(section for section in sections if section)
    return _MEMORY_ADDRESS.sub("", text)  # reprs of defaults without source (builtins) would differ per run


def _api_section(kind: str, name: str, obj) -> str:
    doc = inspect.getdoc(obj)
    if not doc:
        return ""
    try:
        signature = _signature_as_written(obj) if kind != "class" else ""
    except (TypeError, ValueError):  # many builtins have no introspectable signature
        signature = ""
    return f"{kind} {name}{signature}\n\n{doc}"


class _Expression:
    """A default value shown as its source expression."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _signature_as_written(obj) -> str:
    """The signature with each default as the source spells it (`env=os.environ`), not its value's repr:
    a value computed at import (os.environ, sys.executable, an install path) would put this machine's
    environment, secrets included, into the corpus and make it differ between machines. Builtins'
    signatures are text already; a default whose source cannot be read shows as `...`."""
    signature = inspect.signature(obj)
    written = _source_defaults(inspect.unwrap(getattr(obj, "__func__", obj)))
    parameters = [p if p.default is p.empty or written is None else p.replace(default=_Expression(written.get(p.name, "...")))
                  for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters))


def _source_defaults(function) -> dict[str, str] | None:
    """Parameter name -> the source text of its default; None for a function without Python source."""
    code = getattr(function, "__code__", None)
    if code is None:
        return None
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return {}
    node = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                 and (isinstance(n, ast.Lambda) or n.name == code.co_name)), None)
    if node is None:
        return {}
    arguments = node.args
    positional = [*arguments.posonlyargs, *arguments.args]
    pairs = [*zip(positional[len(positional) - len(arguments.defaults):], arguments.defaults),
             *((a, d) for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults) if d is not None)]
    return {argument.arg: ast.unparse(default) for argument, default in pairs}


def is_validation_module(name: str) -> bool:
    return zlib.crc32(name.encode()) % 100 < VALID_PERCENT


def demo_records(max_bytes: int) -> Iterator[tuple[str, dict]]:
    """(split, record) pairs in deterministic order until about `max_bytes` of text."""
    total = 0
    for name in stdlib_module_names():
        module = _import_quietly(name)
        if module is None:
            continue
        text = module_document(module)
        if len(text) < 200:  # a bare title is not a document worth training on
            continue
        url = f"https://docs.python.org/3/library/{name}.html"
        record = {
            "warc_record_id": f"<urn:uuid:{uuid.uuid5(uuid.NAMESPACE_URL, url)}>",
            "url": url,
            "warc_date": WARC_DATE,
            "text": text,
            "language": "en",
            "quality": "high",
        }
        yield ("valid" if is_validation_module(name) else "train"), record
        total += len(text.encode())
        if total >= max_bytes:
            return


def build_demo_corpus(config: DemoCorpusConfig) -> dict[str, int]:
    """Write the files; returns the number of documents per split."""
    splits = {"train": [[] for _ in range(config.train_files)], "valid": [[]]}
    counts = {"train": 0, "valid": 0}
    for split, record in demo_records(int(config.max_mb * 1e6)):
        files = splits[split]
        files[counts[split] % len(files)].append(record)  # round-robin keeps the files similar
        counts[split] += 1
    for split, files in splits.items():
        directory = config.output / split
        directory.mkdir(parents=True, exist_ok=True)
        for index, records in enumerate(files):
            lines = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
            (directory / FILE_NAME.format(index)).write_bytes(
                zstandard.ZstdCompressor(level=10).compress(lines.encode())
            )
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="directory for train/ and valid/")
    parser.add_argument("--max-mb", type=float, default=DemoCorpusConfig.max_mb, help="text size target in MB")
    parser.add_argument("--train-files", "--train-shards", type=int, default=DemoCorpusConfig.train_files,
                        help="files the train split is spread over (--train-shards: its former spelling)")
    args = parser.parse_args(argv)
    counts = build_demo_corpus(DemoCorpusConfig(args.output, args.max_mb, args.train_files))
    print(f"wrote {counts['train']} train and {counts['valid']} valid documents to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
