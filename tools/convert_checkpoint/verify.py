"""Checks an export against the trainer's own model, twice:
1. the Hugging Face model (loaded by transformers from the export) against the trainer's Megatron
   model rebuilt at T=1 P=1 in this process from the merged weights: catches wrong names, wrong
   un-fusing, RoPE/norm convention mismatches and bad writes;
2. that rebuilt model against the logits the tensor- and pipeline-parallel training model recorded
   when it saved the checkpoint: catches a wrong merge of the shards, or a damaged checkpoint.
Also, when the export has a tokenizer, AutoTokenizer must give the training tokenizer's ids.

And an import (`verify_import`) against its Hugging Face source:
1. the logits the imported checkpoint's T x P model recorded (its probe) against transformers' on
   the same tokens: catches a wrong mapping, fusing, sharding or convention;
2. the round trip Hugging Face -> trainer -> Hugging Face (the exporter, into a temporary folder):
   every tensor the mapping moves comes back bit-identical (a bf16 or fp16 source as the same
   values in fp32); the two Gemma computes in its own convention (the (1 + w) norms and the
   sqrt(hidden)-scaled embedding, see hf_mapping) within the two fp32 roundings of the conversion."""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from tools.convert_checkpoint.export import export
from tools.convert_checkpoint.hf_folder import HfWeights
from tools.convert_checkpoint.hf_mapping import EMBEDDING
from tools.convert_checkpoint.merge import WeightSource, full_weights, recorded_probe
from trainer.checkpoint import CheckpointReader
from trainer.checkpoint.checkpointer import PROBE_RELATIVE_TOLERANCE
from trainer.model.presets import ModelShape

# Of the largest reference logit, by the reference's dtype. Every reference is fp32: the export's
# model, and the probe the checkpointer records without autocast (fp32 differences are ~1e-6; a bf16
# forward of the 150m model is ~0.06 away, which no fp32 tolerance would pass).
RELATIVE_TOLERANCE = {torch.float32: PROBE_RELATIVE_TOLERANCE}
# A Gemma-convention tensor after the round trip (hf_mapping): two fp32 roundings of 1 + w (norms) or
# of x * sqrt(hidden) (the embedding), relative to 1 + |w| and to |x|.
GEMMA_ROUNDING = 2.0 ** -22
SAMPLE_TEXT = "To be, or not to be, that is the question."


@dataclass
class Comparison:
    what: str
    max_abs_diff: float
    scale: float
    dtype: torch.dtype = torch.float32  # the reference's

    @property
    def tolerance(self) -> float:
        return RELATIVE_TOLERANCE[self.dtype] * max(1.0, self.scale)

    @property
    def ok(self) -> bool:
        # NaN logits on either side make every difference NaN: never a pass, whatever the comparison says of NaN.
        return math.isfinite(self.max_abs_diff) and math.isfinite(self.scale) and self.max_abs_diff <= self.tolerance

    def __str__(self) -> str:
        return (f"{'ok  ' if self.ok else 'FAIL'} {self.what}: max |diff| {self.max_abs_diff:.3g} "
                f"({str(self.dtype).removeprefix('torch.')} tolerance {self.tolerance:.3g})")


@dataclass
class RoundTrip:
    """Hugging Face tensors after Hugging Face -> trainer -> Hugging Face, against the source."""
    exact: int = 0  # bit-identical tensors
    rounded: int = 0  # Gemma-convention tensors within GEMMA_ROUNDING
    max_rounding: float = 0.0  # their largest |diff|
    wrong: list[str] = field(default_factory=list)  # tensors that differ beyond that, or are missing

    @property
    def ok(self) -> bool:
        return not self.wrong

    def __str__(self) -> str:
        rounded = (f", {self.rounded} in Gemma's (1 + w) / sqrt(hidden) convention within two fp32 roundings "
                   f"(max |diff| {self.max_rounding:.3g})" if self.rounded else "")
        wrong = f"; differ: {', '.join(self.wrong[:6])}{' ...' if len(self.wrong) > 6 else ''}" if self.wrong else ""
        return f"{'ok  ' if self.ok else 'FAIL'} round trip Hugging Face -> trainer -> Hugging Face: " \
               f"{self.exact} tensors bit-identical{rounded}{wrong}"


@dataclass
class VerifyReport:
    comparisons: list[Comparison | RoundTrip] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was not compared, and why

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.comparisons)

    def __str__(self) -> str:
        return "\n".join([str(c) for c in self.comparisons] + [f"note {n}" for n in self.notes]
                         + [f"FAIL {p}" for p in self.problems])


def _compare(what: str, got: torch.Tensor, reference: torch.Tensor) -> Comparison:
    if reference.dtype not in RELATIVE_TOLERANCE:
        raise ValueError(f"{what}: the reference logits are {reference.dtype}; verify compares with fp32 "
                         f"references only (checkpoints record an fp32 probe)")
    got, reference_fp32 = got.cpu().float(), reference.cpu().float()
    return Comparison(what, float((got - reference_fp32).abs().max()), float(reference_fp32.abs().max()),
                      reference.dtype)


def _megatron_model_at_t1(reader: CheckpointReader, source: WeightSource) -> torch.nn.Module:
    """The trainer's model in a single-process gloo world, holding the merged weights."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_patches import apply_cpu_shims_if_needed, initialize_megatron_groups
    from muloco.core.topology import ParallelSizes, build_topology

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    apply_cpu_shims_if_needed()
    timeout = timedelta(minutes=5)
    initialize_megatron_groups(build_topology(ParallelSizes(1, 1, 1, 1), timeout), timeout)
    model_parallel_cuda_manual_seed(0)
    return trainer_model(reader.meta.model, reader.meta.padded_vocab_size, full_weights(reader, source))


def trainer_model(shape: ModelShape, padded_vocab_size: int,
                  weights: Iterable[tuple[str, torch.Tensor]]) -> torch.nn.Module:
    """The trainer's T=1 model holding `weights` (by canonical name), on the device megatron-core
    allocates its own buffers on: where an accelerator exists, RoPE moves its frequencies to the
    current CUDA device at the first forward, so a model left on the CPU would meet them there."""
    from megatron_patches import megatron_device
    from trainer.model.builder import build_model, canonical_names

    device = megatron_device()
    model = build_model(shape, padded_vocab_size, torch.float32)
    names = canonical_names(model)
    params = {names[local]: p for local, p in model.named_parameters()}
    with torch.no_grad():
        for name, full in weights:
            params.pop(name).copy_(full)
    if params:
        raise ValueError(f"checkpoint lacks parameters {sorted(params)[:5]}")
    return model.to(device).eval()


def trainer_logits(model: torch.nn.Module, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [1, L, vocab_size] of the T=1 model, on its device."""
    device = next(model.parameters()).device
    ids = ids.to(device)
    return model(ids, torch.arange(ids.shape[1], device=device).unsqueeze(0), None)[..., :vocab_size]


@torch.no_grad()
def verify(reader: CheckpointReader, hf_dir: str | Path, source: WeightSource) -> VerifyReport:
    from transformers import AutoModelForCausalLM

    report = VerifyReport()
    probe_tokens, recorded = recorded_probe(reader, source.probe_worker or 0)
    sample = probe_tokens
    if reader.tokenizer_path is not None:
        sample = _check_tokenizer(reader, hf_dir, report, fallback=probe_tokens)
    megatron = _megatron_model_at_t1(reader, source)
    device = next(megatron.parameters()).device
    vocab = reader.meta.vocab_size

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
    report.comparisons.append(_compare("transformers export vs trainer model (T=1 P=1)",
                                       hf(input_ids=sample.to(device)).logits, trainer_logits(megatron, sample, vocab)))
    if source.probe_worker is None:  # the probe is of a worker's own weights, which these are not
        report.notes.append("not compared with the training model as saved: its recorded logits are worker 0's "
                            "own weights, and the export holds the global ones")
        return report
    report.comparisons.append(_compare(
        f"trainer model (T=1 P=1) vs training model as saved ({reader.meta.describe_layout()}, worker "
        f"{source.probe_worker})", trainer_logits(megatron, probe_tokens, vocab), recorded))
    return report


def _check_tokenizer(reader: CheckpointReader, hf_dir, report: VerifyReport, fallback: torch.Tensor) -> torch.Tensor:
    """Sample text as ids for the logits comparison; the exported tokenizer must agree with the training one."""
    from transformers import AutoTokenizer

    from tokenizer.interface import load_tokenizer

    expected = load_tokenizer(reader.tokenizer_path).encode(SAMPLE_TEXT)
    got = AutoTokenizer.from_pretrained(hf_dir)(SAMPLE_TEXT, add_special_tokens=False)["input_ids"]
    if got != expected:
        report.problems.append(f"AutoTokenizer ids {got[:12]}... differ from the training tokenizer's {expected[:12]}...")
        return fallback
    return torch.tensor([expected])


@torch.no_grad()
def verify_import(reader: CheckpointReader, hf_dir: str | Path, untied: bool) -> VerifyReport:
    """An imported checkpoint against its Hugging Face source (see the module docstring)."""
    from transformers import AutoModelForCausalLM

    report = VerifyReport()
    tokens, recorded = recorded_probe(reader)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    report.comparisons.append(_compare(f"imported model ({reader.meta.describe_layout()}) vs transformers",
                                       recorded, hf(input_ids=tokens).logits))
    with tempfile.TemporaryDirectory() as exported:
        export(reader, exported, WeightSource.of(reader, None))
        report.comparisons.append(_round_trip(HfWeights(Path(hf_dir), untied), HfWeights(Path(exported), False),
                                              gemma=reader.meta.model.arch == "paper"))
    return report


def _round_trip(source: HfWeights, exported: HfWeights, gemma: bool) -> RoundTrip:
    result = RoundTrip()
    for name in exported.names():
        original, back = source.get(name).float(), exported.get(name)
        if back.shape == original.shape and torch.equal(back, original):
            result.exact += 1
            continue
        computed = gemma and (name.endswith("norm.weight") or name == EMBEDDING)
        if computed and back.shape == original.shape:
            diff = (back - original).abs()
            scale = 1.0 + original.abs() if name.endswith("norm.weight") else original.abs()
            if bool((diff <= GEMMA_ROUNDING * scale).all()):
                result.rounded += 1
                result.max_rounding = max(result.max_rounding, float(diff.max()))
                continue
        result.wrong.append(name)
    result.wrong += sorted(set(source.names()) - set(exported.names()))
    return result
