"""The comparison's methods: what each is (inner optimizer, K workers, pseudogradient compression).

The one list both tools/write_compare_configs.py (which writes configs/compare/ from it and the
paper's recipe) and the protocol (which runs those configs) read. A compressed variant is judged
against its uncompressed method at that method's setting, so it selects none of its own (`tuned_as`).
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


def _compressed(name: str, base: str, optimizer: str, method: str, bits: int, error_feedback: bool) -> MethodSpec:
    return MethodSpec(name, optimizer, 4, {"method": method, "bits": bits, "error_feedback": error_feedback,
                                          "embedding_bits": 32, "vector_bits": 32}, tuned_as=base)


METHODS: tuple[MethodSpec, ...] = (
    MethodSpec("dp_adamw", "adamw", None),
    MethodSpec("dp_muon", "muon", None),
    *[MethodSpec(f"{family}_k{k}", optimizer, k) for k in KS for family, optimizer in (("diloco", "adamw"),
                                                                                       ("muloco", "muon"))],
    # The paper's codec: hidden matrices quantized, embeddings, head and 1-D tensors in fp32.
    _compressed("diloco_k4_stat4", "diloco_k4", "adamw", "statistical", 4, False),
    _compressed("muloco_k4_stat4", "muloco_k4", "muon", "statistical", 4, False),
    _compressed("muloco_k4_stat2ef", "muloco_k4", "muon", "statistical", 2, True),
    _compressed("muloco_k4_lin2ef", "muloco_k4", "muon", "linear", 2, True),
)
BY_NAME = {m.name: m for m in METHODS}
METHOD_ORDER = tuple(m.name for m in METHODS)
UNCOMPRESSED = tuple(m.name for m in METHODS if m.compression is None)
