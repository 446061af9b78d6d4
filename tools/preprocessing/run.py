"""One preprocessing run (or partition of one): its input groups planned chunk by chunk, the chunks finished by an
earlier run reused, the rest handed to the tokenizing processes, and each group's files (and the partition's
manifest) written as soon as the group is done, so that a rerun resumes where this one stopped."""
from __future__ import annotations

import functools
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dataprep.chunks import Chunk, chunk_bytes_for, plan_chunks
from dataprep.fingerprints import chunk_fingerprint, file_fingerprint, group_fingerprint, part_identity
from dataprep.group_files import DatasetIdentity, GroupOutput, write_group_files
from dataprep.input_files import BadRecord, is_parquet, resolve_inputs
from dataprep.listing import Listing
from dataprep.manifest import (
    GroupRecord,
    ManifestError,
    OutputFile,
    PartitionManifest,
    SubsetStats,
    manifest_path,
    output_file_problem,
    read_manifest,
    write_manifest,
)
from dataprep.partition import InputGroup, Partition, assign_groups, plan_groups
from dataprep.parts import (
    BAD_RECORDS_REPORTED_PER_FILE,
    ChunkStats,
    InputFilePlan,
    completed_chunk_stats,
    part_prefix,
    rename_format_1_parts,
    reuse_finished_file,
    write_file_plan,
)
from dataprep.progress import ProgressLine
from tokenizer.identity import tokenizer_identity
from tokenizer.interface import load_tokenizer
from tools.preprocessing.config import PreprocessConfig
from tools.preprocessing.dispatch import ChunkDispatcher
from tools.preprocessing.tokenize_worker import StrictModeError, token_dtype


@dataclass
class PreprocessSummary:
    input_files: int
    chunks: int
    reused_chunks: int  # complete parts reused from an earlier run
    reused_groups: int  # whole input groups a partition's earlier run finished
    documents: int
    tokens: int
    max_token_id: int
    empty_documents: int
    bad_records: int
    bad_by_kind: dict[str, int]
    subsets: dict[str, SubsetStats]
    files: list[str]  # dataset prefixes written (or kept from an earlier run)
    manifest: Path | None  # the partition's manifest (one output per group)
    seconds: float  # the whole run
    # First chunk handed out to last chunk done: imports, tokenizer loading and the merge excluded (the
    # processes' own start is in: it runs in parallel with the first chunks).
    tokenize_seconds: float
    processed_tokens: int  # tokenized in this run, excluding reused parts
    processed_bytes: int

    @property
    def tokens_per_second(self) -> float:
        return self.processed_tokens / max(self.tokenize_seconds, 1e-9)

    @property
    def megabytes_per_second(self) -> float:
        return self.processed_bytes / 1e6 / max(self.tokenize_seconds, 1e-9)


class NoDocumentsError(ValueError):
    """Every record was empty or bad: an empty dataset would only fail later, in training."""


@dataclass
class _GroupWork:
    output: GroupOutput
    plans: list[InputFilePlan] = field(default_factory=list)
    stats: dict[tuple[int, int], ChunkStats] = field(default_factory=dict)
    pending: int = 0  # chunks handed out and not yet done
    planned: bool = False


class _Preprocess:
    """One run (or partition): its input groups planned, tokenized and written, group by group."""

    def __init__(self, config: PreprocessConfig):
        self.config = config
        self.listing = Listing.of(resolve_inputs(config.inputs))
        tokenizer = load_tokenizer(config.tokenizer_model, config.tokenizer_type)
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.dataset_identity = DatasetIdentity(self.dtype, tokenizer.vocab_size, tokenizer_identity(tokenizer))
        self.part_identity = part_identity(self.dataset_identity.tokenizer_sha256, config.json_key, config.append_eod,
                                           self.dtype, config.max_document_bytes, config.max_inflate_ratio)
        self.output_identity = {**self.part_identity, "input_files_per_output": config.input_files_per_output or 1,
                                "max_tokens_per_file": config.max_tokens_per_file}
        if config.output_per_group:
            groups = plan_groups(self.listing, config.input_files_per_output or 1)
            self.partition = config.partition or Partition(0, 1, "the whole input")
            self.groups = assign_groups(groups, self.partition.count)[self.partition.index]
        else:
            everything = tuple(range(len(self.listing.files)))
            self.groups = [InputGroup(0, "", everything, sum(file.size for file in self.listing.files))]
            self.partition = None
        self.manifest: PartitionManifest | None = None
        self.records: dict[int, GroupRecord] = {}  # finished groups (one output per group)
        self.subsets: dict[str, SubsetStats] = {}
        self.files: list[str] = []
        self.max_token_id = -1
        self.chunks = self.reused_chunks = self.reused_groups = 0
        self._work_of_file: dict[int, _GroupWork] = {}
        self._files_done: set[int] = set()
        label = f"partition {self.partition}: " if config.partition else ""
        self.progress = ProgressLine(label, sum(len(group.input_files) for group in self.groups),
                                     sum(group.size for group in self.groups))

    def output_of(self, group: InputGroup) -> GroupOutput:
        if not self.config.output_per_group:
            return GroupOutput(group, self.config.output_prefix, pieces=False)
        return GroupOutput(group, f"{self.config.output_prefix}_{group.index:06d}",
                           pieces=self.config.max_tokens_per_file is not None)

    def run(self) -> PreprocessSummary:
        start = time.monotonic()
        Path(self.config.output_prefix).parent.mkdir(parents=True, exist_ok=True)
        if self.config.output_per_group:
            self._open_manifest()
        with ChunkDispatcher(self.config, self.dtype, self._chunk_done, self.progress) as dispatcher:
            for group in self.groups:
                if group.index in self.records:
                    continue
                self._plan_group(group, dispatcher)
            dispatcher.finish()
            tokenize_seconds = (dispatcher.last_done or 0.0) - (dispatcher.first_submit or 0.0)
            new_stats = dispatcher.new_stats
        if self.reused_chunks:
            print(f"resuming: reused {self.reused_chunks} finished chunks of {self.chunks}", file=sys.stderr)
        manifest_file = None
        if self.manifest is not None:
            self.manifest.groups = [self.records[index] for index in sorted(self.records)]
            self.manifest.complete = True
            manifest_file = self._write_manifest()
        self.progress.print()
        totals = SubsetStats()
        for stats in self.subsets.values():
            totals.add(stats)
        if totals.documents == 0 and self.groups:
            where = (f"; {manifest_file} records its input files as covered" if manifest_file
                     else f"; nothing was written to {self.config.dataset_prefix}")
            raise NoDocumentsError(f"no document written: every record of the {totals.input_files} input file(s) was "
                                   f"empty or bad (see the bad records above){where}")
        return PreprocessSummary(
            input_files=totals.input_files, chunks=self.chunks, reused_chunks=self.reused_chunks,
            reused_groups=self.reused_groups, documents=totals.documents, tokens=totals.tokens,
            max_token_id=self.max_token_id, empty_documents=totals.empty_documents,
            bad_records=totals.dropped_records, bad_by_kind=totals.dropped, subsets=self.subsets, files=self.files,
            manifest=manifest_file, seconds=time.monotonic() - start, tokenize_seconds=tokenize_seconds,
            processed_tokens=sum(s.tokens for s in new_stats), processed_bytes=sum(s.input_bytes for s in new_stats))

    # -- planning and handing out

    def _plan_group(self, group: InputGroup, dispatcher: ChunkDispatcher) -> None:
        work = _GroupWork(self.output_of(group))
        parts_dir = work.output.parts_dir
        parts_dir.mkdir(parents=True, exist_ok=True)
        rename_format_1_parts(parts_dir)
        for file_index in group.input_files:
            path = self.listing.files[file_index].path
            chunk_bytes = chunk_bytes_for(path, self.config.chunk_bytes)
            plan = InputFilePlan(file_index, path, file_fingerprint(path, self.part_identity, chunk_bytes))
            work.plans.append(plan)
            self._work_of_file[file_index] = work
            finished = reuse_finished_file(parts_dir, plan)
            if finished is not None:
                work.stats.update(finished)
                self.chunks += len(finished)
                self.reused_chunks += len(finished)
                plan.planned = True
                self._file_finished(work, plan)
                continue
            for chunk, payload in plan_chunks(file_index, path, chunk_bytes, self.config.json_key,
                                              self.config.max_document_bytes,
                                              functools.partial(_file_problem, self.config, plan),
                                              self.config.max_inflate_ratio):
                plan.chunks.append(chunk)
                self.chunks += 1
                fingerprint = chunk_fingerprint(plan.fingerprint, chunk)
                previous = completed_chunk_stats(parts_dir, chunk, fingerprint)
                if previous is not None:
                    work.stats[(file_index, chunk.index)] = previous
                    self.reused_chunks += 1
                else:
                    work.pending += 1
                    dispatcher.submit(chunk, payload, fingerprint, part_prefix(parts_dir, chunk))
            write_file_plan(parts_dir, plan)
            plan.planned = True
            self._file_finished(work, plan)
        work.planned = True
        if work.pending == 0:
            self._finish_group(work)

    def _chunk_done(self, chunk: Chunk, stats: ChunkStats) -> None:
        # A JSONL chunk spans its (decompressed) bytes; a parquet one its row groups, whose text is counted.
        read_bytes = stats.input_bytes if is_parquet(chunk.path) else chunk.stop - chunk.start
        self.progress.chunk_done(stats.records, read_bytes)
        work = self._work_of_file[chunk.file_index]
        work.stats[(chunk.file_index, chunk.index)] = stats
        work.pending -= 1
        self._file_finished(work, next(plan for plan in work.plans if plan.file_index == chunk.file_index))
        if work.planned and work.pending == 0:
            self._finish_group(work)  # at once: its parts go, and the manifest records it for a resume

    def _file_finished(self, work: _GroupWork, plan: InputFilePlan) -> None:
        """Count the input file as done for the progress line once it is planned whole and all its chunks are in."""
        if plan.planned and plan.file_index not in self._files_done and all(
                (plan.file_index, chunk.index) in work.stats for chunk in plan.chunks):
            self._files_done.add(plan.file_index)
            self.progress.file_done(self.listing.files[plan.file_index].size)

    # -- writing a finished group

    def _finish_group(self, work: _GroupWork) -> None:
        group = work.output.group
        group_stats = SubsetStats()
        for plan in work.plans:
            file_stats = _account_file(plan, [work.stats[(plan.file_index, chunk.index)] for chunk in plan.chunks])
            self.subsets.setdefault(self.listing.files[plan.file_index].subset, SubsetStats()).add(file_stats)
            group_stats.add(file_stats)
        written = group_stats.documents > 0
        files = self._write_files(work) if written else []
        if not self.config.keep_parts:
            shutil.rmtree(work.output.parts_dir, ignore_errors=True)
        if not self.config.output_per_group and not written:
            return  # run() reports it; nothing is written
        if self.manifest is not None:
            self.records[group.index] = GroupRecord(
                group.index, group.subset, [self.listing.files[p].name for p in group.input_files],
                group_fingerprint(self.output_identity, self.listing, group), files, group_stats)
            self.manifest.groups = [self.records[index] for index in sorted(self.records)]
            self._write_manifest()

    def _write_files(self, work: _GroupWork) -> list[OutputFile]:
        chunks = [chunk for plan in work.plans for chunk in plan.chunks]
        files = write_group_files(work.output, chunks, work.stats, self.dataset_identity,
                                  self.config.max_tokens_per_file)
        self.files += [work.output.dataset_prefix(piece) for piece in range(len(files))]
        self.max_token_id = max([self.max_token_id, *(file.max_token_id for file in files)])
        return files

    # -- the partition's manifest

    def _manifest_path(self) -> Path:
        return manifest_path(self.config.output_prefix, self.partition.index, self.partition.count)

    def _write_manifest(self) -> Path:
        path = self._manifest_path()
        write_manifest(path, self.manifest)
        return path

    def _open_manifest(self) -> None:
        """Start the manifest, keeping the groups an earlier run of this partition finished intact."""
        self.manifest = PartitionManifest(self.partition.index, self.partition.count, self.output_identity,
                                          str(self.listing.root), self.listing.identity())
        path = self._manifest_path()
        try:
            previous = read_manifest(path) if path.exists() else None
        except ManifestError as error:
            print(f"not resuming from {path}: {error}", file=sys.stderr)
            previous = None
        if previous is not None and (previous.run, previous.listing) == (self.manifest.run, self.manifest.listing):
            expected = {group.index: group for group in self.groups}
            for record in previous.groups:
                group = expected.get(record.index)
                if group is None or record.fingerprint != group_fingerprint(self.output_identity, self.listing, group):
                    continue
                if any(output_file_problem(path.parent, output) for output in record.files):
                    continue
                self.records[record.index] = record
                self.reused_groups += 1
                self.subsets.setdefault(record.subset, SubsetStats()).add(record.stats)
                self.files += [str(path.parent / output.name) for output in record.files]
                self.max_token_id = max([self.max_token_id, *(output.max_token_id for output in record.files)])
                for file_index in group.input_files:
                    self.progress.file_done(self.listing.files[file_index].size, reused=True)
        if self.reused_groups:
            print(f"resuming: partition {self.partition} reuses {self.reused_groups} finished group(s) of "
                  f"{len(self.groups)}", file=sys.stderr)
        self.manifest.groups = [self.records[index] for index in sorted(self.records)]
        self._write_manifest()


def run_preprocess(config: PreprocessConfig) -> PreprocessSummary:
    """Tokenize all input files (of this partition) and write the indexed datasets. Raises on errors (see main)."""
    return _Preprocess(config).run()



def _file_problem(config: PreprocessConfig, plan: InputFilePlan, record: BadRecord) -> None:
    if config.strict:
        raise StrictModeError(f"bad record (--strict): {record}")
    plan.problems.append(record)


def _account_file(plan: InputFilePlan, chunk_stats: list[ChunkStats]) -> SubsetStats:
    """Print the input file's first bad records with their line in the file; return its counts."""
    stats = SubsetStats(input_files=1)
    records: list[BadRecord] = list(plan.problems)
    lines_before = well_formed = 0
    for chunk in chunk_stats:
        records += [BadRecord(str(plan.path), lines_before + line, kind, detail)
                    for line, kind, detail in chunk.bad_examples]
        for kind, count in chunk.bad_by_kind.items():
            stats.dropped[kind] = stats.dropped.get(kind, 0) + count
        lines_before += chunk.records
        well_formed += chunk.documents + chunk.empty_documents
        stats.documents += chunk.documents
        stats.tokens += chunk.tokens
        stats.empty_documents += chunk.empty_documents
    for record in plan.problems:
        stats.dropped[record.kind] = stats.dropped.get(record.kind, 0) + 1
    if well_formed == 0 and not any(record.line == 0 for record in plan.problems):
        records.append(BadRecord(str(plan.path), 0, "empty_file", "the file holds no document"))
        stats.dropped["empty_file"] = stats.dropped.get("empty_file", 0) + 1
    records.sort(key=lambda record: record.line)
    for record in records[:BAD_RECORDS_REPORTED_PER_FILE]:
        print(f"bad record: {record}", file=sys.stderr)
    if stats.dropped_records > BAD_RECORDS_REPORTED_PER_FILE:
        print(f"bad record: ... and {stats.dropped_records - BAD_RECORDS_REPORTED_PER_FILE} more in {plan.path}",
              file=sys.stderr)
    return stats
