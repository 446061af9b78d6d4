"""Checks an export against the trainer's own model, twice:
1. the Hugging Face model (loaded by transformers from the export) against the trainer's Megatron
   model rebuilt at T=1 P=1 in this process from the merged weights: catches wrong names, wrong
   un-fusing, RoPE/norm convention mismatches and bad writes;
2. that rebuilt model against the logits the tensor- and pipeline-parallel training model recorded
   when it saved the checkpoint: catches a wrong merge of the shards, or a damaged checkpoint.
Also, when the export has a tokenizer, AutoTokenizer must give the training tokenizer's ids."""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tools.convert_checkpoint.merge import full_weights, recorded_probe
from trainer.checkpoint import CheckpointReader

RELATIVE_TOLERANCE = 1e-4  # of the largest reference logit; fp32 differences are ~1e-6
SAMPLE_TEXT = "To be, or not to be, that is the question."


@dataclass
class Comparison:
    what: str
    max_abs_diff: float
    scale: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= RELATIVE_TOLERANCE * max(1.0, self.scale)

    def __str__(self) -> str:
        return (f"{'ok  ' if self.ok else 'FAIL'} {self.what}: max |diff| {self.max_abs_diff:.3g} "
                f"(tolerance {RELATIVE_TOLERANCE * max(1.0, self.scale):.3g})")


@dataclass
class VerifyReport:
    comparisons: list[Comparison] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(c.ok for c in self.comparisons)

    def __str__(self) -> str:
        return "\n".join([str(c) for c in self.comparisons] + [f"FAIL {p}" for p in self.problems])


def _compare(what: str, got: torch.Tensor, reference: torch.Tensor) -> Comparison:
    return Comparison(what, float((got - reference).abs().max()), float(reference.abs().max()))


def _megatron_model_at_t1(reader: CheckpointReader) -> torch.nn.Module:
    """The trainer's model in a single-process gloo world, holding the merged weights."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_patches import apply_cpu_shims_if_needed, initialize_megatron_groups
    from trainer.model.builder import build_model, canonical_names
    from trainer.topology import ParallelSizes, build_topology

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    apply_cpu_shims_if_needed()
    timeout = timedelta(minutes=5)
    initialize_megatron_groups(build_topology(ParallelSizes(1, 1, 1, 1), timeout), timeout)
    model_parallel_cuda_manual_seed(0)
    model = build_model(reader.meta.model, reader.meta.padded_vocab_size, torch.float32)
    names = canonical_names(model)
    params = {names[local]: p for local, p in model.named_parameters()}
    with torch.no_grad():
        for name, full in full_weights(reader):
            params.pop(name).copy_(full)
    if params:
        raise ValueError(f"checkpoint lacks parameters {sorted(params)[:5]}")
    return model.eval()


@torch.no_grad()
def verify(reader: CheckpointReader, hf_dir: str | Path) -> VerifyReport:
    from transformers import AutoModelForCausalLM

    report = VerifyReport()
    probe_tokens, recorded = recorded_probe(reader)
    sample = probe_tokens
    if reader.tokenizer_path is not None:
        sample = _check_tokenizer(reader, hf_dir, report, fallback=probe_tokens)
    megatron = _megatron_model_at_t1(reader)

    def trainer_logits(ids: torch.Tensor) -> torch.Tensor:
        return megatron(ids, torch.arange(ids.shape[1]).unsqueeze(0), None)[..., :reader.meta.vocab_size]

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    report.comparisons.append(_compare("transformers export vs trainer model (T=1 P=1)",
                                       hf(input_ids=sample).logits, trainer_logits(sample)))
    report.comparisons.append(_compare(
        f"trainer model (T=1 P=1) vs training model as saved ({reader.meta.describe_layout()})",
        trainer_logits(probe_tokens), recorded))
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
