"""The comparison's methods: what each is (inner optimizer, K workers, pseudogradient compression).

The one list both tools/write_compare_configs.py (which writes configs/compare/ from it and the
paper's recipe) and the protocol (which runs those configs) read. A compressed variant is judged
against its uncompressed method at that method's setting, so it selects none of its own (`tuned_as`).

Two sets of compressed variants: K=4 over the all-gather (the comparison's first, claims d1-d3), and
the codec at the paper's settings (issue 44, claims d1'-d3', g1-g2): K=8, the reduce-scatter
collective, which re-quantizes the average as the official sweep's `simulate_quantization_after_reduce`
does, quantization groups per row and per tensor, and SparseLoCo's top-k + 2-bit values. The tiny
model's rows are 128 wide; per tensor, a group is a reduce-scatter chunk of a tensor (rows/8 of it:
2,048 elements for a 128 x 128 matrix, 5,632 for the MLP's), as wide as the paper's rows or wider.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

KS = (1, 2, 4, 8)


@dataclass(frozen=True)
class MethodSpec:
    name: str
    optimizer: Literal["adamw", "muon"]
    workers: int | None  # None: data parallel, no outer loop
    compression: dict[str, Any] | None = None  # the muloco.compression block's choice; None: uncompressed
    tuned_as: str | None = None  # runs at this method's selected setting instead of selecting its own
    collective: Literal["all_gather", "reduce_scatter"] = "all_gather"

    @property
    def family(self) -> str:
        """`dp_adamw`/`dp_muon` for the baselines, else `diloco` (AdamW inner) or `muloco` (Muon inner)."""
        if self.workers is None:
            return f"dp_{self.optimizer}"
        return "muloco" if self.optimizer == "muon" else "diloco"

    @property
    def start_method(self) -> str:
        """The data-parallel baseline of the same inner optimizer (whose states the alignment branches from)."""
        return f"dp_{self.optimizer}"


# The paper's codec: hidden matrices quantized, embeddings, head and 1-D tensors in fp32.
PAPER_GROUPS = {"embedding_bits": 32, "vector_bits": 32}
# The project's bytes goal (>= 400x fewer bytes than DP) needs the embeddings and head compressed too
# (results/compression_groups.md); 1-D tensors stay fp32 (a few KB).
EVERY_MATRIX = {"embedding_bits": 2, "vector_bits": 32}  # topk: any width but 32 means "compressed"


def _compressed(name: str, base: str, codec: dict[str, Any], groups: dict[str, int] = PAPER_GROUPS,
                collective: Literal["all_gather", "reduce_scatter"] = "all_gather") -> MethodSpec:
    tuned = BY_NAME_UNCOMPRESSED[base]
    return MethodSpec(name, tuned.optimizer, tuned.workers, {**codec, **groups}, tuned_as=base, collective=collective)


def _over_reduce_scatter(name: str, base: str, codec: dict[str, Any], groups: dict[str, int] = PAPER_GROUPS) -> MethodSpec:
    return _compressed(name, base, codec, groups, "reduce_scatter")


def _quantized(method: str, bits: int, error_feedback: bool, **granularity: str) -> dict[str, Any]:
    return {"method": method, "bits": bits, "error_feedback": error_feedback, **granularity}


UNCOMPRESSED_METHODS = (
    MethodSpec("dp_adamw", "adamw", None),
    MethodSpec("dp_muon", "muon", None),
    *[MethodSpec(f"{family}_k{k}", optimizer, k) for k in KS for family, optimizer in (("diloco", "adamw"),
                                                                                       ("muloco", "muon"))],
)
BY_NAME_UNCOMPRESSED = {m.name: m for m in UNCOMPRESSED_METHODS}
# SparseLoCo: top-2% of each tensor (a chunk of it, as above), the kept values at 2 bits, error feedback.
# Over the all-gather, as SparseLoCo sends: re-sparsifying the average of K sparse payloads (the
# reduce-scatter) would drop most of it with no error feedback to carry it.
SPARSELOCO = {"method": "topk", "topk_fraction": 0.02, "topk_value_bits": 2, "granularity": "tensor",
              "error_feedback": True}

METHODS: tuple[MethodSpec, ...] = (
    *UNCOMPRESSED_METHODS,
    _compressed("diloco_k4_stat4", "diloco_k4", _quantized("statistical", 4, False)),
    _compressed("muloco_k4_stat4", "muloco_k4", _quantized("statistical", 4, False)),
    _compressed("muloco_k4_stat2ef", "muloco_k4", _quantized("statistical", 2, True)),
    _compressed("muloco_k4_lin2ef", "muloco_k4", _quantized("linear", 2, True)),
    _over_reduce_scatter("diloco_k8_stat4", "diloco_k8", _quantized("statistical", 4, False)),
    _over_reduce_scatter("muloco_k8_stat4", "muloco_k8", _quantized("statistical", 4, False)),
    _over_reduce_scatter("muloco_k8_stat2ef", "muloco_k8", _quantized("statistical", 2, True)),
    _over_reduce_scatter("muloco_k8_lin2ef", "muloco_k8", _quantized("linear", 2, True)),
    _over_reduce_scatter("muloco_k8_stat2ef_tensor", "muloco_k8", _quantized("statistical", 2, True, granularity="tensor")),
    _over_reduce_scatter("muloco_k8_lin2ef_tensor", "muloco_k8", _quantized("linear", 2, True, granularity="tensor")),
    _over_reduce_scatter("muloco_k8_stat2ef_emb2", "muloco_k8", _quantized("statistical", 2, True), EVERY_MATRIX),
    _compressed("muloco_k8_sparseloco", "muloco_k8", SPARSELOCO, EVERY_MATRIX),
)
BY_NAME = {m.name: m for m in METHODS}
METHOD_ORDER = tuple(m.name for m in METHODS)
UNCOMPRESSED = tuple(m.name for m in METHODS if m.compression is None)
