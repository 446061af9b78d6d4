"""tools/plan.py against the real thing: parameter counts of the model built on meta, memory that adds
up, and outer-sync bytes equal to what the trainer's collectives count in a real K=2 run."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tools import plan as planner
from muloco.core.errors import ConfigError
from tools.planning.inputs import PlanInputs
from tools.planning.memory import stage_memory
from tools.planning.plan import GIB, layouts_that_fit, make_plan
from tools.planning import shards
from tools.planning.shards import build_stage_shards
from tools.planning.synced import hook_synced
from megatron_world import megatron_world_of_one
from tools.trainer_runs import PRETRAIN, launch_ranks, read_metrics
from tools.trainer_runs import TINY_VOCAB
from tools.synthetic_data import write_markov_dataset
from trainer.model.presets import PRESETS, parameter_count

PRESETS_UP_TO_1_76B = ["tiny", "150m", "416m", "914m", "1.76b"]
ROOT = Path(__file__).resolve().parents[1]


def _inputs(*flags: str) -> PlanInputs:
    return planner.inputs_from_args(planner.build_parser().parse_args(list(flags)))


def _built_parameter_count(preset: str, vocab: int) -> int:
    """Every parameter of the whole GPTModel, built on meta in a gloo world of one."""
    from trainer.model.builder import build_model, padded_vocab_size

    with megatron_world_of_one(), torch.device("meta"):
        model = build_model(PRESETS[preset], padded_vocab_size(vocab, 1))
        return sum(p.numel() for p in model.parameters())


def _paper_formula(preset: str, vocab: int) -> int:
    """Per layer: QKV, output projection, SwiGLU (gate, up, down), two RMSNorms (four with the
    paper's post-norms) and the QK-norms; untied embedding and head; the final norm."""
    s = PRESETS[preset]
    h, f, d = s.hidden_size, s.ffn_hidden_size, s.kv_channels
    attention = h * d * (s.num_attention_heads + 2 * s.query_groups) + s.num_attention_heads * d * h
    layer = attention + 3 * h * f + (4 if s.arch == "paper" else 2) * h + 2 * d
    return s.num_layers * layer + 2 * vocab * h + h


@pytest.mark.parametrize("preset", PRESETS_UP_TO_1_76B)
def test_parameter_count_equals_the_built_model(preset):
    vocab = 1024 if preset == "tiny" else planner.PAPER_VOCAB
    built = _built_parameter_count(preset, vocab)
    assert built == _paper_formula(preset, vocab) == parameter_count(PRESETS[preset], vocab)
    for tensor, pipeline in ((1, 1), (2, 2)):
        stages = build_stage_shards(PRESETS[preset], vocab, tensor, pipeline)
        assert len(stages) == pipeline
        assert shards.parameter_count(stages, tensor) == built


def test_paper_presets_have_their_names_sizes():
    counts = {p: _paper_formula(p, planner.PAPER_VOCAB) for p in ("150m", "416m", "914m", "1.76b", "3.1b", "15b")}
    for preset, count in counts.items():
        nominal = float(preset.rstrip("mb")) * (1e6 if preset.endswith("m") else 1e9)
        assert abs(count / nominal - 1) < 0.1, (preset, count)


@pytest.mark.parametrize("ds_config", ["ds_configs/gpu_150m_muloco_k1.json", "ds_configs/gpu_150m_dp_adamw.json"])
def test_memory_adds_up(ds_config):
    plan = make_plan(_inputs("--model", "150m", "--tensor-model-parallel-size", "2",
                                     "--pipeline-model-parallel-size", "2", "--data", "2", "--workers", "2",
                                     "--global-batch-size", "64", "--ds_config", ds_config))
    for memory in plan.memory:
        parts = ("weights", "bf16_weight_copies", "gradients", "muon_momentum", "adamw_moments", "muon_workspace",
                 "activations", "logits")
        assert memory.device_total == sum(getattr(memory, p) for p in parts)
        n = memory.weights / 4
        assert memory.gradients == memory.weights and memory.bf16_weight_copies == 2 * n
        # Every parameter has exactly one optimizer's state.
        assert memory.muon_momentum / 4 + memory.adamw_moments / 8 == n
    muon_inner, adamw = plan.memory
    if plan.inputs.optimizer.type == "adamw":
        assert muon_inner == adamw and adamw.muon_momentum == 0
    else:
        assert muon_inner.muon_momentum > 0 and muon_inner.muon_workspace > 0
    assert adamw.adamw_moments == 2 * adamw.weights
    # Host outer state: each of the D replicas keeps fp32 global + momentum + pseudogradient of about half.
    assert 12 * n / 2 <= plan.memory[0].host_outer_state <= 12 * n + 4 * n



def test_bf16_momentum_halves_muon_momentum_and_adds_one_fp32_sum_to_the_step():
    inputs = _inputs("--model", "150m", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                     "--data", "2", "--workers", "2", "--global-batch-size", "64", "--ds_config", "ds_configs/gpu_150m_muloco_k1.json")
    params = inputs.optimizer.params
    bf16 = replace(inputs, optimizer=replace(inputs.optimizer, params=replace(params, momentum_dtype="bfloat16")))
    stages = build_stage_shards(PRESETS["150m"], planner.PAPER_VOCAB, 2, 2)
    for i, stage in enumerate(stages):
        fp32_memory, bf16_memory = (stage_memory(i, stage, x, muon_inner=True) for x in (inputs, bf16))
        assert bf16_memory.muon_momentum == fp32_memory.muon_momentum / 2 > 0
        # The step forms the sum of one parameter's momentum in fp32 while it packs the exchange.
        largest = max(p.numel for p in stage if p.muon)
        assert 0 <= bf16_memory.muon_workspace - fp32_memory.muon_workspace <= 4 * largest

def test_the_planner_takes_the_ds_config_by_the_trainers_flag_and_its_aliases():
    for spelling in ("--ds_config", "--deepspeed_config", "--ds-config"):
        args = planner.build_parser().parse_args(["--model", "tiny", spelling, "ds_configs/cpu_tiny_muloco.json"])
        assert args.ds_config == "ds_configs/cpu_tiny_muloco.json"


def test_15b_k16_config_fits_an_80gb_gpu_at_its_own_layout():
    plan = make_plan(_inputs("--model", "15b", "--ds_config", "ds_configs/gpu_15b_muloco_k16.json"))
    sizes = plan.inputs.sizes
    assert (sizes.workers, sizes.data, sizes.pipeline, sizes.tensor) == (16, 4, 2, 4)  # the config's layout block
    assert plan.inputs.micro_batch == 1 and plan.inputs.global_batch == 4096
    assert plan.fits
    assert plan.memory[0].device_total < 70 * GIB


def test_uneven_15b_layouts_on_8_gpu_nodes():
    """36 heads and 54 layers: T=8 cannot split the heads, P=4 splits the layers 13 + 14 + 14 + 13."""
    inputs = _inputs("--model", "15b", "--ds_config", "ds_configs/gpu_15b_muloco_k16.json")
    stages = build_stage_shards(PRESETS["15b"], planner.PAPER_VOCAB, 2, 4)
    layers = [len({n.split(".")[2] for n in (p.name for p in stage) if n.startswith("decoder.layers.")})
              for stage in stages]
    assert layers == [13, 14, 14, 13]
    assert shards.parameter_count(stages, 2) == parameter_count(PRESETS["15b"], planner.PAPER_VOCAB)
    fits = {(f.tensor, f.pipeline): f.fits for f in layouts_that_fit(inputs, max_pipeline=4)}
    assert not any(t == 8 for t, _ in fits)
    assert fits[(4, 2)] and fits[(2, 4)] and not fits[(1, 1)]
    # The CLI refuses a layout that does not fit.
    assert planner.main(["--model", "15b", "--ds_config", "ds_configs/gpu_15b_muloco_k16.json",
                         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "1"]) == 1


@pytest.mark.launch
def test_sync_bytes_equal_the_trainers_collectives(tmp_path, repo_root):
    """K=2 x D=2, a reduce-scatter at 2 bits; the all-gather at T=2 and 4 bits is checked on
    test_outer_loop's CLI run, which launches it anyway."""
    config = json.loads((repo_root / "ds_configs" / "cpu_tiny_muloco.json").read_text())
    config["muloco"].update(workers=2, sync_interval=2, collective="reduce_scatter",
                            compression={"method": "statistical", "bits": 2, "embedding_bits": 2, "vector_bits": 2})
    (tmp_path / "ds.json").write_text(json.dumps(config))
    data = write_markov_dataset(str(tmp_path / "markov"), vocab_size=TINY_VOCAB, num_docs=60)
    run_dir = tmp_path / "run"
    launch_ranks(PRETRAIN, 4, [
        "--ds_config", str(tmp_path / "ds.json"), "--model", "tiny", "--data-path", data,
        "--vocab-size", str(TINY_VOCAB), "--train-iters", "2", "--eval-interval", "0", "--run-dir", str(run_dir)],
        timeout_s=900).check("K=2 MuLoCo run")  # 4 ranks start slowly on a shared 2-core machine
    (measured,) = [r["bytes_sent_per_rank"] for r in read_metrics(run_dir) if "outer_step" in r]

    plan = make_plan(_inputs(
        "--model", "tiny", "--seq-length", "128", "--vocab-size", str(TINY_VOCAB), "--tensor-model-parallel-size", "1",
        "--data", "2", "--global-batch-size", "8", "--micro-batch-size", "1", "--ds_config", str(tmp_path / "ds.json")))
    assert plan.sync.per_rank_mean == measured
    assert plan.sync.per_rank_max >= measured


def test_codec_time_from_the_codec_benchmark_adds_to_each_sync(tmp_path):
    """--codec-json prices the busiest rank's encode and decode into every sync, by the formulas in
    the planner's docstring; a setting the benchmark did not measure is one clear error."""
    rows = [{"method": "statistical", "bits": 4, "encode_elements_per_s": 2e8, "decode_elements_per_s": 5e8},
            {"method": "linear", "bits": 4, "encode_elements_per_s": 1.0, "decode_elements_per_s": 1.0}]
    codec = tmp_path / "codec.txt"
    codec.write_text("model 150m ...\n" + json.dumps({"rows": rows}) + "\n")
    flags = ["--model", "150m", "--workers", "4", "--data", "2", "--global-batch-size", "64", "--compression",
             "statistical:4", "--collective", "all_gather"]
    plain, priced = make_plan(_inputs(*flags)), make_plan(_inputs(*flags, "--codec-json", str(codec)))
    stages = build_stage_shards(PRESETS["150m"], planner.PAPER_VOCAB, 1, 1)
    owned = sum(p.numel for p in stages[0]) / 2  # one of D = 2 replicas' share
    codec_s = owned / 2e8 + 4 * owned / 5e8
    syncs = plain.times[-1].steps // 30
    assert priced.times[-1].total_hours - plain.times[-1].total_hours == pytest.approx(syncs * codec_s / 3600)
    assert priced.times[:2] == plain.times[:2]  # DP has no codec
    with pytest.raises(ConfigError, match="no row for statistical 2"):
        _inputs(*flags[:-4], "--compression", "statistical:2", "--codec-json", str(codec))


SHIPPED = sorted((ROOT / "ds_configs").glob("*.json")) + sorted((ROOT / "configs" / "compare").glob("*.json"))


@pytest.mark.parametrize("path", [*SHIPPED, None], ids=[p.stem for p in SHIPPED] + ["all_defaults"])
def test_the_planner_reads_every_config_as_the_trainer_does(path, tmp_path):
    """Optimizer, bf16, batch, layout and outer loop: the planner's inputs are the trainer's values
    (with no muloco block the planner plans the outer loop at its defaults)."""
    from trainer.config import build_parser, resolve
    from muloco.diloco.config import MuLoCoConfig

    if path is None:  # every block left out: the trainer's defaults (AdamW, fp32), not the planner's own
        path = tmp_path / "empty.json"
        path.write_text("{}")
    raw = json.loads(path.read_text())
    model = raw.get("recipe", {}).get("model", "tiny")
    layout = {"tensor": 1, "pipeline": 1, "data": 1, **raw.get("layout", {})}
    plan = _inputs("--model", model, "--ds_config", str(path))
    elastic = "elastic" in raw.get("muloco", {})
    run = resolve(build_parser().parse_args([
        "--ds_config", str(path), "--model", model, "--data-path", "x",
        "--tensor-model-parallel-size", str(layout["tensor"]), "--pipeline-model-parallel-size", str(layout["pipeline"]),
        *(["--worker-id", "0"] if elastic else [])]),
        (1 if elastic else plan.sizes.workers) * layout["data"] * layout["pipeline"] * layout["tensor"])
    assert plan.optimizer == run.optimizer
    assert plan.bf16 == run.bf16
    assert (plan.micro_batch, plan.global_batch, plan.micro_batches) == (
        run.batch.micro_batch_size, run.batch.global_batch, run.batch.gradient_accumulation_steps)
    assert (plan.sizes.tensor, plan.sizes.pipeline, plan.sizes.data, plan.sizes.workers) == (
        run.tensor_parallel, run.pipeline_parallel, run.batch.data_parallel, run.batch.workers)
    assert plan.muloco == (run.muloco or MuLoCoConfig())


def test_the_planner_refuses_a_config_made_for_another_model():
    assert planner.main(["--model", "3.1b", "--ds_config", "ds_configs/gpu_15b_muloco_k16.json"]) == 2


def test_a_hook_run_partitions_what_zero_partitions_and_syncs_each_element_once():
    flags = ("--model", "150m", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--data", "4",
             "--workers", "2", "--global-batch-size", "64", "--ds_config", "ds_configs/gpu_150m_muloco_k1.json")
    plans = {zero: make_plan(replace(_inputs(*flags), hook_zero=zero)) for zero in (0, 1, 3)}
    trainer = make_plan(_inputs(*flags))
    n = sum(p.numel for p in build_stage_shards(PRESETS["150m"], planner.PAPER_VOCAB, 2, 2)[0])
    for zero, plan in plans.items():
        memory = plan.memory[1]  # AdamW: 8 bytes of moments per parameter, partitioned from ZeRO 1
        assert memory.adamw_moments == pytest.approx(8 * n / (4 if zero else 1), rel=0.2)
        assert memory.master_weights == pytest.approx(4 * n / (4 if zero else 1), rel=0.2)  # bf16 weights
    assert plans[1].memory[0].device_total < plans[0].memory[0].device_total
    # ZeRO-3 holds 1/D of the bf16 weights, and keeps those it gathers for the forward (all of a 150m
    # stage: fewer than DeepSpeed's 1e9 live parameters) until the backward.
    zero3 = plans[3].memory[1]
    stage_numel = zero3.master_weights  # 4 bytes per parameter over D = 4
    assert zero3.weights == pytest.approx(2 * (stage_numel / 4 + stage_numel))
    # The same elements are synced, cut differently: a partition's pieces against whole tensors.
    for zero in (1, 3):
        assert plans[zero].sync.per_rank_mean == pytest.approx(trainer.sync.per_rank_mean, rel=0.02)
    stage = build_stage_shards(PRESETS["150m"], planner.PAPER_VOCAB, 1, 1)[0]
    for zero in (1, 3):
        pieces = [hook_synced(stage, zero, 4, d) for d in range(4)]
        assert sum(p.numel for replica in pieces for p in replica) == sum(p.numel for p in stage)
