"""Every shipped ds_config (and the all-defaults config) resolves to the run it resolved to before the
typed loader: tests/data/resolved_configs.json holds the values trainer/config.py resolved at commit
d3fb722 (main before it) for each ds_configs/ file and the empty configs, plain and with
six flag combinations (the `recipe` cases since updated for DiLoCo's K=1 outer momentum 0.8, and every
muloco block for streaming.max_overlap_steps, a new setting that only `overlap_steps: auto` reads, and for
final_sync, on by default: a run whose last step is not a sync step now ends with one more; every
elastic block for quorum_request_timeout_s, a new setting: a quorum request unanswered that long is
asked again; every muon block for ns_form, new, `auto`, and momentum_dtype, new, `float32`; every muloco
block for emulate_slowdown and pace, new settings whose defaults leave a run as it was: no emulated
slowdown, fixed-H syncs; every elastic block for min_workers, new, absent: min(2, K), which refuses a
quorum of one worker that the run before it took; every compression block for granularity, new, `row`,
and topk_value_bits, new, 32: the codec as it was). A
changed default or a value that takes another path shows up here as a changed run. The comparison's
configs/compare/ are generated from the recipe and checked against it (tests/test_compare_configs.py)."""
import dataclasses
import json
from pathlib import Path

import pytest

from trainer.config import RunConfig, build_parser, resolve
from trainer.optim.config import MuonParams

ROOT = Path(__file__).resolve().parents[1]
EXPECTED = json.loads((ROOT / "tests" / "data" / "resolved_configs.json").read_text())
VARIANTS = {
    "plain": [],
    "peak_flags": ["--lr", "0.05", "--weight-decay", "0.01"],
    "as_muon": ["--optimizer", "muon"],
    "as_adamw": ["--optimizer", "adamw"],
    "schedule_flags": ["--train-iters", "7", "--lr-warmup-iters", "2", "--min-lr-ratio", "0.2", "--clip-grad", "0.5"],
    "batch_flags": ["--micro-batch-size", "1"],
    "recipe": ["--recipe", "paper", "--lr", "0.01"],
}
EMPTY = {"empty.json": {}, "empty_muloco.json": {"muloco": {}}}


def _cases():
    for path in [*sorted((ROOT / "ds_configs").glob("*.json")), *EMPTY]:
        name = path if path in EMPTY else str(path.relative_to(ROOT))
        for variant in VARIANTS:
            yield f"{name}:{variant}"


def _flags(case: str, raw: dict) -> tuple[list[str], int]:
    name, variant = case.split(":")
    muloco = raw.get("muloco")
    workers = (muloco or {}).get("workers", 1)
    layout = raw.get("layout", {"tensor": 1, "pipeline": 1, "data": 2})
    elastic = "elastic" in (muloco or {})
    world = (1 if elastic else workers) * layout["data"] * layout["pipeline"] * layout["tensor"]
    model = raw.get("recipe", {}).get("model", "150m" if name in EMPTY else "tiny")
    flags = ["--model", model, "--data-path", "x", "--vocab-size", "64",
             "--tensor-model-parallel-size", str(layout["tensor"]),
             "--pipeline-model-parallel-size", str(layout["pipeline"]), *(["--worker-id", "0"] if elastic else []),
             *VARIANTS[variant]]
    if variant == "recipe" and "recipe" not in raw:
        flags = ["--model", "150m", *flags[2:]]
    if variant == "batch_flags":
        flags += ["--global-batch-size", str(workers * layout["data"] * 4)]
    return flags, world


def resolved_values(config: RunConfig) -> dict:
    """What the run uses from the ds_config, in a form independent of how the dataclasses nest."""
    p = config.optimizer.params
    optimizer = {"type": config.optimizer.type, "lr": p.lr, "weight_decay": p.weight_decay, "betas": p.betas,
                 "eps": p.eps}
    if isinstance(p, MuonParams):
        optimizer.update(adamw_lr_factor=p.adamw_lr_factor, adamw_weight_decay_factor=p.adamw_weight_decay_factor,
                         muon={k: getattr(p, k) for k in ("momentum", "nesterov", "ns_schedule", "ns_steps", "ns_dtype",
                                                          "ns_form", "momentum_dtype", "lr_scaling")})
    values = {"batch": dataclasses.asdict(config.batch), "bf16": config.bf16, "ds_config": config.ds_config,
              "muloco": None if config.muloco is None else dataclasses.asdict(config.muloco), "optimizer": optimizer,
              "schedule": {**dataclasses.asdict(config.schedule), "clip_grad": config.clip_grad},
              "recipe_table": config.recipe_table}
    return json.loads(json.dumps(values))  # tuples as lists, as in the file


def test_every_case_is_expected():
    assert sorted(_cases()) == sorted(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_config_resolves_to_the_same_run(tmp_path, case):
    name = case.split(":")[0]
    path = ROOT / name
    if name in EMPTY:
        path = tmp_path / name
        path.write_text(json.dumps(EMPTY[name]))
    flags, world = _flags(case, json.loads(path.read_text()))
    config = resolve(build_parser().parse_args(["--ds_config", str(path), *flags]), world)
    assert resolved_values(config) == EXPECTED[case]
