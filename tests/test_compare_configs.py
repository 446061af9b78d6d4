"""The method comparison's ds_configs (configs/compare): each is the generator's output, each follows
the paper's recipe (checked against trainer/recipe.py and the authors' tuned outer points, not
against the generator), each resolves with the comparison's flags to the paper's architecture and
batch split, and methods differ only where the comparison means them to."""
import json
from pathlib import Path

import pytest

from tools.compare.launch import Data, trainer_flags, with_job_secret
from tools.compare.methods import BY_NAME, EVERY_MATRIX, METHOD_ORDER, PAPER_GROUPS
from tools.compare.protocol import RunSpec, Settings
from tools.write_compare_configs import compare_ds_config
from trainer.config import build_parser, resolve
from muloco.diloco.auth import KEY_FILE_ENV, key_file_is_private, read_job_key
from muloco.core.errors import ConfigError
from trainer.recipe import paper_recipe

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs" / "compare"
CONFIGS = {p.stem: json.loads(p.read_text()) for p in sorted(CONFIG_DIR.glob("*.json"))}
SETTINGS = Settings()
# The authors' tuned outer (lr, momentum): MuLoCo K=1, DiLoCo K=1, and every K > 1.
PAPER_OUTER = {("muon", 1): (0.7, 0.6), ("adamw", 1): (0.7, 0.8)}
BYTES_GOAL = ("muloco_k8_stat2ef_emb2", "muloco_k8_sparseloco")  # every matrix compressed (claims g1, g2)


def _differences(a, b, path="") -> set[str]:
    """Dotted paths where two JSON values differ (a key present on one side only counts)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return set().union(*(_differences(a.get(k), b.get(k), f"{path}.{k}".lstrip(".")) for k in set(a) | set(b)))
    return set() if a == b else {path}


def test_every_config_is_the_generators_output():
    assert set(CONFIGS) == set(METHOD_ORDER)
    for name, config in CONFIGS.items():
        assert config == compare_ds_config(BY_NAME[name]), \
            f"{name}.json differs from the recipe: run python tools/write_compare_configs.py"


@pytest.mark.parametrize("name", METHOD_ORDER)
def test_config_follows_the_papers_recipe(name):
    spec, config = BY_NAME[name], CONFIGS[name]
    workers, B = spec.workers or 1, SETTINGS.global_batch
    params = config["optimizer"]["params"]
    # The weight-decay rule for this B and K, with the paper's smallest model's base.
    assert params["weight_decay"] == pytest.approx(paper_recipe("150m", workers, B, spec.optimizer).weight_decay)
    assert params["weight_decay"] == pytest.approx((0.01 if spec.optimizer == "muon" else 0.001) * (B / workers) / 512)
    if spec.optimizer == "muon":
        assert (params["adamw_lr_factor"], params["adamw_weight_decay_factor"]) == (1.0, 1.0)
    assert (config["scheduler"]["params"]["min_lr_ratio"], config["gradient_clipping"]) == (0.1, 1.0)
    assert config["recipe"]["model"] == "tiny" and config["recipe"]["global_batch"] == B
    assert set(config["recipe"]["not_from_the_paper"]) >= {"optimizer.params.lr", "scheduler.params.train_iters",
                                                           "scheduler.params.warmup_iters"}
    if spec.workers is None:
        assert "muloco" not in config
        return
    block = config["muloco"]
    assert (block["outer_lr"], block["outer_momentum"]) == PAPER_OUTER.get((spec.optimizer, workers), (1.0, 0.9))
    assert block["nesterov"] and block["sync_interval"] == 30
    compression = block["compression"]
    if compression["method"] != "none":  # the paper's codec: fp32 embeddings, head and norms; official forms
        groups = EVERY_MATRIX if name in BYTES_GOAL else PAPER_GROUPS
        assert (compression["embedding_bits"], compression["vector_bits"]) == tuple(groups.values())
        bits = compression["topk_value_bits"] if compression["method"] == "topk" else compression["bits"]
        assert compression["error_feedback"] == (bits == 2)
        if compression["error_feedback"]:
            assert (compression["ef_form"], compression["ef_beta"]) == ("paper", 0.9)
        if compression["method"] == "statistical":
            assert compression["statistical_rounding"] == "paper"


@pytest.mark.parametrize("name", METHOD_ORDER)
def test_config_resolves_with_the_comparisons_flags(name, tmp_path):
    workers = BY_NAME[name].workers or 1
    flags = trainer_flags(RunSpec(name, 0.01, None, 1), SETTINGS, Data("x", "x", ("--vocab-size", "4096"), "0" * 64), workers,
                          tmp_path, eval_interval=30)
    config = resolve(build_parser().parse_args(["--ds_config", str(CONFIG_DIR / f"{name}.json"), *flags]),
                     world_size=workers)
    assert config.model.arch == "paper" and config.model.post_norms and config.model.document_masking
    assert config.model.query_groups == config.model.num_attention_heads  # no grouped-query attention
    assert config.batch.workers == workers and config.batch.global_batch == SETTINGS.global_batch
    assert (config.batch.micro_batch_size, config.batch.gradient_accumulation_steps) == (16 // workers, 1)
    assert config.optimizer.params.lr == 0.01  # the flag wins over the config's grid centre


@pytest.mark.parametrize("a, b, allowed", [
    ("dp_adamw", "dp_muon", {"optimizer", "recipe.inner_optimizer"}),
    ("diloco_k1", "muloco_k1", {"optimizer", "recipe.inner_optimizer", "muloco.outer_momentum"}),
    *[(f"diloco_k{k}", f"muloco_k{k}", {"optimizer", "recipe.inner_optimizer"}) for k in (2, 4, 8)],
    ("diloco_k4_stat4", "muloco_k4_stat4", {"optimizer", "recipe.inner_optimizer"}),
    *[(f"{m}_k4", f"{m}_k4_{c}", {"muloco.compression"}) for m, c in
      (("diloco", "stat4"), ("muloco", "stat4"), ("muloco", "stat2ef"), ("muloco", "lin2ef"))],
    *[(f"{m}_k1", f"{m}_k{k}", {"muloco.workers", "muloco.outer_lr", "muloco.outer_momentum",
                                "train_micro_batch_size_per_gpu", "optimizer.params.weight_decay"})
      for m in ("diloco", "muloco") for k in (2, 4, 8)],
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


def test_a_launch_whose_workers_talk_brings_its_own_job_secret(tmp_path, monkeypatch):
    """The trainer refuses workers that talk without a secret; each launch writes one beside its config
    (so the comparison needs no $MULOCO_AUTH_KEY_FILE), and K = 1 gets none."""
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    raw = CONFIGS["muloco_k2"]

    def resolved(config: dict):
        path = tmp_path / "ds_config.json"
        path.write_text(json.dumps(config))
        return resolve(build_parser().parse_args(["--ds_config", str(path), "--data-path", "x"]), world_size=2)

    with pytest.raises(ConfigError, match="workers exchange pseudogradients, so the job needs a secret"):
        resolved(raw)
    config = resolved(with_job_secret(raw, tmp_path))
    assert config.auth_key_file == str(tmp_path / "job.key")
    assert read_job_key(tmp_path / "job.key", "x") and key_file_is_private(tmp_path / "job.key")
    assert with_job_secret(CONFIGS["muloco_k1"], tmp_path) == CONFIGS["muloco_k1"]
