"""A preprocessing run's settings (tools/preprocess_data.py's flags)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dataprep.input_files import DEFAULT_MAX_DOCUMENT_BYTES, DEFAULT_MAX_INFLATE_RATIO
from dataprep.partition import Partition


@dataclass(frozen=True)
class PreprocessConfig:
    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer_model: Path
    tokenizer_type: str | None = None  # None: read from the model file
    json_key: str = "text"
    append_eod: bool = True
    processes: int = 1
    strict: bool = False
    keep_parts: bool = False
    chunk_bytes: int | None = None  # None: a share of each input file (dataprep.chunks.chunk_bytes_for)
    partition: Partition | None = None  # None: this process covers the whole input
    input_files_per_output: int | None = None  # None: 1 when there is one output per input group
    max_tokens_per_file: int | None = None
    max_document_bytes: int = DEFAULT_MAX_DOCUMENT_BYTES  # longer records are dropped as bad
    max_inflate_ratio: float = DEFAULT_MAX_INFLATE_RATIO  # a compressed file inflating further is cut there

    @property
    def output_per_group(self) -> bool:
        """One output per input group (else one output for everything)."""
        return not (self.partition is None and self.input_files_per_output is None
                    and self.max_tokens_per_file is None)

    @property
    def dataset_prefix(self) -> str:
        """The single output's dataset prefix (without one output per group)."""
        return f"{self.output_prefix}_text_document"
