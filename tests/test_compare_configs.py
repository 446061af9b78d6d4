"""The method comparison's ds_configs (configs/compare): each resolves, and methods differ only where
the comparison means them to."""
import json
from pathlib import Path

import pytest

from trainer.config import build_parser, resolve

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "compare"
CONFIGS = {p.stem: json.loads(p.read_text()) for p in sorted(CONFIG_DIR.glob("*.json"))}
GLOBAL_BATCH = 16


def _workers(raw: dict) -> int:
    return raw.get("muloco", {}).get("workers", 1)


def _differences(a, b, path="") -> set[str]:
    """Dotted paths where two JSON values differ (a key present on one side only counts)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(_differences(a.get(k), b.get(k), f"{path}.{k}".lstrip(".")) for k in set(a) | set(b)))
    return set() if a == b else {path}


def test_every_method_of_the_comparison_is_here():
    from tools.compare.protocol import METHOD_ORDER

    assert set(CONFIGS) == set(METHOD_ORDER)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_resolves_with_the_same_global_batch(name):
    workers = _workers(CONFIGS[name])
    args = build_parser().parse_args(["--ds_config", str(CONFIG_DIR / f"{name}.json"), "--data-path", "x",
                                      "--global-batch-size", str(GLOBAL_BATCH)])
    config = resolve(args, world_size=workers)
    assert config.batch.workers == workers
    assert config.batch.global_batch == GLOBAL_BATCH
    # The paper's split: B/K sequences per worker, in one micro-batch.
    assert config.batch.micro_batch_size == GLOBAL_BATCH // workers
    assert config.batch.gradient_accumulation_steps == 1


@pytest.mark.parametrize("a, b, allowed", [
    ("dp_adamw", "dp_muon", {"optimizer"}),
    *[(f"diloco_k{k}", f"muloco_k{k}", {"optimizer"}) for k in (1, 2, 4)],
    *[(f"diloco_k4_{c}", f"muloco_k4_{c}", {"optimizer"}) for c in ("stat4", "stat2ef")],
    *[(f"{m}_k4", f"{m}_k4_{c}", {"muloco.compression"}) for m in ("diloco", "muloco") for c in ("stat4", "stat2ef")],
    *[("muloco_k4_stat4", f"muloco_k4_stat4_{c}", {"muloco.compression"}) for c in ("paper", "emb8")],
    ("muloco_k4_stat2ef", "muloco_k4_lin2ef", {"muloco.compression.method"}),
    *[(f"{m}_k1", f"{m}_k{k}", {"muloco.workers", "muloco.outer_lr", "muloco.outer_momentum",
                                "train_micro_batch_size_per_gpu"}) for m in ("diloco", "muloco") for k in (2, 4)],
])
def test_methods_differ_only_where_intended(a, b, allowed):
    differences = _differences(CONFIGS[a], CONFIGS[b])
    assert differences, f"{a} and {b} are the same config"
    assert {d for d in differences if not any(d == p or d.startswith(p + ".") for p in allowed)} == set()


@pytest.mark.parametrize("inner", ["adamw", "muon"])
def test_dp_baseline_is_the_k1_config_without_the_outer_loop(inner):
    dp = CONFIGS[f"dp_{inner}"]
    k1 = CONFIGS[f"{'muloco' if inner == 'muon' else 'diloco'}_k1"]
    assert _differences(dp, k1) == {"muloco"}


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if "muloco" in c])
def test_outer_loop_starts_from_the_papers_tuned_points(name):
    block = CONFIGS[name]["muloco"]
    expected = (0.7, 0.6) if block["workers"] == 1 else (1.0, 0.9)
    assert (block["outer_lr"], block["outer_momentum"]) == expected
    compression = block["compression"]
    if compression["method"] != "none":
        assert compression["error_feedback"] == (compression["bits"] == 2)
