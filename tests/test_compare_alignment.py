"""The alignment measure of the method comparison (tools/compare/alignment.py). In process: its start
steps, the per-matrix cosines (the fused weights split as Muon splits them, against cosines computed by
hand) and the stats over seeds and start steps. On real launches, branching from a DP Muon run's start
states: at K = 1 the averaged pseudogradient (the outer momentum after one sync from zero) IS the
reference's full-batch pseudogradient, so the cosine is 1 to fp32 rounding over the whole model and every
matrix."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from _ckpt_runs import dataset
from compare_fixtures import alignment_record

from tools.compare import alignment
from tools.compare.launch import Data, launch, run_config, trainer_flags
from tools.compare.protocol import Method, RunSpec, Settings
from tools.compare.stats import alignment_stats, alignment_summaries
from trainer.checkpoint.format import complete_iterations
from trainer.model.presets import PRESETS

SETTINGS = Settings(steps=6, sync_interval=2, warmup=1, global_batch=4, eval_batches=1)


@pytest.fixture(scope="module")
def dp_states(tmp_path_factory):
    """A DP Muon run of 6 steps keeping its states at the start steps (2 and 4)."""
    base = tmp_path_factory.mktemp("alignment")
    prefix = dataset(base)
    data = Data(prefix, prefix, ("--vocab-size", "1000"), "0" * 64)  # records are not written here
    dp = Method.load("dp_muon")
    run_dir, root = base / "dp", base / "dp" / "ckpt"
    flags = trainer_flags(RunSpec(dp.name, 0.02, None, 1), SETTINGS, data, 1, run_dir, eval_interval=0)
    launch(run_config(dp, SETTINGS, None), flags + alignment.start_state_flags(SETTINGS, root), 1, run_dir,
           timeout_s=600)
    steps = alignment.start_steps(SETTINGS)
    assert steps == (2, 4) and complete_iterations(root) == [2, 4, 6]
    # A cosine of 1 is not automatic at this scale: consecutive H-step pseudogradients differ.
    theta = {step: alignment.worker0_state(root, step)["model"] for step in (2, 4, 6)}
    shape = alignment.CheckpointReader(root, 2).meta.model
    assert alignment.compare(*({n: theta[a][n] - theta[a + 2][n] for n in theta[a]} for a in (2, 4)), shape).cosine < 0.999
    alignment.keep_only(root, steps)
    assert complete_iterations(root) == [2, 4] and alignment.has_start_states(root, steps)
    return data, root, base


@pytest.mark.launch  # starts processes (tests/launch_tier.py)
def test_k1_branch_reproduces_the_full_batch_reference(dp_states):
    data, root, base = dp_states
    method = Method.load("muloco_k1")
    measured = alignment.measure(method, RunSpec(method.name, 0.01, 0.7, 1), SETTINGS, data, root, 2, base / "k1")
    assert measured.losses is None  # held-out losses only where asked for
    result = measured.alignment
    assert result.cosine == pytest.approx(1.0, abs=1e-6)
    assert result.norm_ratio == pytest.approx(1.0, abs=1e-4)
    assert len(result.matrix_cosines) == 4 * 7  # per layer q, k, v, proj, gate, up, fc2
    assert min(result.matrix_cosines.values()) == pytest.approx(1.0, abs=1e-5)
    assert not (base / "k1").exists()  # its checkpoints are removed once measured


def test_start_steps_are_multiples_of_h_inside_the_run():
    assert alignment.start_steps(Settings()) == (60, 150, 240)
    assert alignment.start_steps(Settings(steps=20, sync_interval=10, warmup=2)) == (10,)
    assert alignment.start_steps(Settings(steps=10, sync_interval=10, warmup=2)) == ()


def test_per_matrix_cosines_split_the_fused_weights_as_muon_does():
    """Reference: the cosine of each logical matrix computed by hand from the slices."""
    shape = replace(PRESETS["tiny"], num_query_groups=None, arch="paper")
    h, d, f = shape.hidden_size, shape.kv_channels, shape.ffn_hidden_size
    g = torch.Generator().manual_seed(0)
    a = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(3 * 4 * d, h, generator=g),
         "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(2 * f, h, generator=g),
         "embedding.word_embeddings.weight": torch.randn(64, h, generator=g),
         "decoder.final_layernorm.weight": torch.randn(h, generator=g)}
    b = {n: t.clone() for n, t in a.items()}
    qkv = b["decoder.layers.0.self_attention.linear_qkv.weight"].view(4, 3 * d, h)
    qkv[:, :d] *= -1  # every query head reversed: q's cosine -1, k and v's 1
    b["decoder.layers.0.mlp.linear_fc1.weight"][f:] = torch.randn(f, h, generator=g)  # up replaced
    result = alignment.compare(a, b, shape)
    up_a, up_b = a["decoder.layers.0.mlp.linear_fc1.weight"][f:], b["decoder.layers.0.mlp.linear_fc1.weight"][f:]
    assert result.matrix_cosines == pytest.approx({
        "decoder.layers.0.self_attention.linear_qkv.weight:q": -1.0,
        "decoder.layers.0.self_attention.linear_qkv.weight:k": 1.0,
        "decoder.layers.0.self_attention.linear_qkv.weight:v": 1.0,
        "decoder.layers.0.mlp.linear_fc1.weight:gate": 1.0,
        "decoder.layers.0.mlp.linear_fc1.weight:up": float(torch.nn.functional.cosine_similarity(
            up_a.reshape(-1).double(), up_b.reshape(-1).double(), dim=0))})
    flat_a = torch.cat([a[n].reshape(-1) for n in sorted(a)]).double()
    flat_b = torch.cat([b[n].reshape(-1) for n in sorted(a)]).double()
    assert result.cosine == pytest.approx(float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0)))
    assert result.norm_ratio == pytest.approx(float(flat_a.norm() / flat_b.norm()))


def test_alignment_stats_count_a_seed_once_every_start_step_is_measured():
    records = {r.key: r for r in [alignment_record(seed=1, step=10, cosine=0.8), alignment_record(seed=1, step=30,
                                  cosine=0.6), alignment_record(seed=2, step=10, cosine=0.9)]}
    (summary,) = alignment_summaries(records, (10, 30)).values()
    assert summary.cosine.by_seed == {1: pytest.approx(0.7)}  # seed 2 lacks step 30
    assert summary.by_start == {10: pytest.approx(0.85), 30: pytest.approx(0.6)}
    assert summary.matrix_mean == pytest.approx((0.75 + 0.55 + 0.85) / 3)
    assert alignment_stats(alignment_summaries(records, (10, 30)), multiplier=2.0) == {}
