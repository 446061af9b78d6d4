"""The outer loop on DeepSpeed engines of models no rank holds whole (muloco/hook/): ZeRO-3 partitions,
Megatron-core tensor and pipeline shards.

One 4-rank launch (tests/_deepspeed_parallel_hook_probe.py) trains K=2 workers of
- the example's Hugging Face Llama at D=2 under ZeRO-3 (some parameters kept whole between steps,
  some partitioned), and with optimizer and parameter offload and 4-bit + EF syncs;
- examples/megatron_muloco.py's Megatron-core GPT at T=2 (ZeRO-1; and ZeRO-0 with 4-bit + EF) and
  at P=2 (Megatron's 1F1B schedule), D=1.
The references are plain: K model copies in this process (the Llama of tests/test_deepspeed_hook.py;
the GPT built whole, T = P = 1), torch's AdamW, and torch.optim.SGD (Nesterov momentum) on the average
pseudogradient as the outer step; each rank's shard is cut from the reference's whole parameters.
"""
from __future__ import annotations

import importlib.util
from argparse import Namespace
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import pytest
import torch
from megatron_world import megatron_world_of_one
from test_deepspeed_hook import cached_reference

from muloco import data_parallel_workers
from muloco.core.errors import ConfigError

from tools.trainer_runs import REPO_ROOT, launch_ranks, shared_memory_files

PROBE = REPO_ROOT / "tests" / "_deepspeed_parallel_hook_probe.py"
K, H, STEPS = 2, 3, 9
OUTER = {"outer_lr": 0.7, "outer_momentum": 0.6, "nesterov": True}


@cache
def probe_results(tmp: str) -> Path:
    out = Path(tmp) / "out"
    result = launch_ranks(PROBE, 4, [str(out)], timeout_s=900)
    for path in shared_memory_files(result.master_port):
        path.unlink(missing_ok=True)
    result.check("the parallel DeepSpeed hook probe")
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    return probe_results(str(tmp_path_factory.mktemp("deepspeed_parallel_hook")))


def load(out: Path, case: str, rank: int) -> dict:
    return torch.load(out / f"{case}.rank{rank}.pt", weights_only=False)


def relative_errors(weights: dict, expected: dict) -> dict[str, float]:
    return {n: float((weights[n] - expected[n]).norm() / expected[n].norm()) for n in weights}


def assert_close(weights: dict, expected: dict, rtol: float, where) -> None:
    errors = relative_errors(weights, expected)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= rtol, (where, worst, errors[worst])


def assert_workers_agree(runs: list[dict], syncs: int = STEPS // H) -> None:
    """The same shard on both workers after every inner step, and `syncs` syncs taken."""
    by_shard = {}
    for run in runs:
        c = run["coords"]
        by_shard.setdefault((c.data, c.pipeline, c.tensor), []).append(run)
    for shard, (first, *others) in by_shard.items():
        assert len(others) == K - 1 and first["outer_steps"] == syncs, shard
        assert all(other["checksums"] == first["checksums"] for other in others), shard


# -- ZeRO-3 ----------------------------------------------------------------------------------------

def whole_parameters(runs: list[dict], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A worker's parameters from its ranks' ZeRO-3 partitions (synced as `name@offset` pieces)."""
    flat = {n: torch.full((w.numel(),), float("nan")) for n, w in like.items()}
    for run in runs:
        for key, piece in run["synced"].items():
            name, _, offset = key.rpartition("@")
            flat[name][int(offset):int(offset) + piece.numel()] = piece.reshape(-1)
    return {n: f.view_as(like[n]) for n, f in flat.items()}


# DeepSpeed's ZeRO-3 computes gradients that differ from PyTorch's autograd by ~3e-7 relative in a single
# process, before any outer loop (plain ZeRO-3 lands 1.7e-6 from the reference after one AdamW step); 9
# steps carry that to ~1.3e-5. Without the refresh of the model's partitions after a sync the run lands
# ~1e-1 away.
ZERO3_RTOL = 1e-4


@pytest.mark.launch
def test_zero3_partitions_are_diloco_computed_by_hand(results):
    expected = cached_reference("adamw")
    for k in range(K):
        runs = [load(results, "zero3", rank) for rank in (2 * k, 2 * k + 1)]
        assert_close(whole_parameters(runs, expected), expected, ZERO3_RTOL, ("worker", k))
    assert_workers_agree([load(results, "zero3", rank) for rank in range(4)])


@pytest.mark.launch
def test_zero3_with_offload_and_4bit_syncs_leaves_the_workers_bit_identical(results):
    assert_workers_agree([load(results, "zero3_offload_4bit", rank) for rank in range(4)])


@pytest.mark.launch
def test_zero1_with_optimizer_offload_and_4bit_syncs_leaves_the_workers_bit_identical(results):
    assert_workers_agree([load(results, "zero1_offload_4bit", rank) for rank in range(4)])


def llama_shard_params() -> list:
    """The example's Llama as tools/plan.py describes a stage's parameters."""
    from muloco.hook.engine_shards import _embedding_parameters
    from test_deepspeed_hook import VOCAB, SEQ, _example
    from tools.plan import ShardParam

    model = _example().llama(VOCAB, SEQ)
    embedding = _embedding_parameters(model)
    return [ShardParam(name, tuple(p.shape), False, False, id(p) in embedding) for name, p in model.named_parameters()]


@pytest.mark.parametrize("case, zero", [("zero1_offload_4bit", 1), ("zero3", 3)])
@pytest.mark.launch
def test_the_planners_hook_shard_is_what_each_rank_syncs(results, case, zero):
    """tools/plan.py --hook-zero sizes memory and bytes from the pieces it expects a rank to sync:
    the same names, offsets and wire shapes as the hook's on DeepSpeed's real partitions."""
    from tools.plan import hook_synced

    params = llama_shard_params()
    for rank in range(4):
        got = load(results, case, rank)["synced"]
        planned = hook_synced(params, zero, data=2, replica=rank % 2)
        assert [(p.name, p.wire_shape) for p in planned] == [(n, tuple(t.shape)) for n, t in got.items()], rank


# -- Megatron-core tensor and pipeline parallelism -------------------------------------------------

def _gpt_example():
    spec = importlib.util.spec_from_file_location("megatron_muloco", REPO_ROOT / "examples" / "megatron_muloco.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpt_reference(shape: Namespace) -> dict[str, torch.Tensor]:
    """The global weights after STEPS steps of K whole GPTs of `shape` (each worker one replica, D=1,
    its micro-batches' mean gradient), a sync every H steps; one intra-op thread, as each rank has."""
    gpt = _gpt_example()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with megatron_world_of_one():
            models = [gpt.gpt(shape.vocab, shape.seq_length, shape.hidden, shape.layers) for _ in range(K)]
            optimizers = [torch.optim.AdamW(m.parameters(), lr=shape.lr, betas=(0.9, 0.95), weight_decay=0.0)
                          for m in models]
            streams = [gpt.markov_batches(shape.vocab, shape.seq_length, shape.micro_batch, seed=k) for k in range(K)]
            global_weights = {n: p.detach().clone() for n, p in models[0].named_parameters()}
            outer = torch.optim.SGD(list(global_weights.values()), lr=OUTER["outer_lr"],
                                    momentum=OUTER["outer_momentum"], nesterov=OUTER["nesterov"])
            for step in range(1, STEPS + 1):
                for model, optimizer, stream in zip(models, optimizers, streams):
                    model.zero_grad(set_to_none=True)
                    for _ in range(shape.micro_batches):
                        output, loss = gpt.forward_step(stream, model)
                        (loss(output)[0] / shape.micro_batches).backward()
                    optimizer.step()
                if step % H == 0:
                    with torch.no_grad():
                        for n, g in global_weights.items():
                            g.grad = sum(g - dict(m.named_parameters())[n] for m in models) / K
                        outer.step()
                        for model in models:
                            for n, p in model.named_parameters():
                                p.copy_(global_weights[n])
            return global_weights
    finally:
        torch.set_num_threads(threads)


@cache
def cached_gpt_reference(shape: tuple) -> dict[str, torch.Tensor]:
    return gpt_reference(Namespace(**dict(shape)))


# Per parameter, ||shard - reference's|| <= RTOL ||reference's||. At P=2 the stages compute what the whole
# model does (2.4e-7 from the reference: DeepSpeed's fp32 AdamW against torch's). At T=2 Megatron's
# row-parallel layers and vocab-parallel cross-entropy add partial sums in another order (~1e-7 of the
# activations), which AdamW carries to 1.6e-6 in 9 steps at lr 1e-3 (4.9e-6 at 3e-3); a wrong outer
# step moves weights by ~1e-2.
GPT_RTOL = {"tensor2": 1e-5, "pipeline2": 1e-6}


@pytest.mark.parametrize("case", ["tensor2", "pipeline2"])
@pytest.mark.launch
def test_tensor_and_pipeline_shards_are_diloco_computed_by_hand(results, case):
    runs = [load(results, case, rank) for rank in range(4)]
    expected = cached_gpt_reference(runs[0]["shape"])
    for rank, run in enumerate(runs):
        tensor_size = 2 if case == "tensor2" else 1
        shard = {n: w for n, (w, _) in run["parameters"].items()}
        cut = {n: expected[n] if dim is None else expected[n].chunk(tensor_size, dim)[run["coords"].tensor]
               for n, (_, dim) in run["parameters"].items()}
        assert_close(shard, cut, GPT_RTOL[case], (case, rank))
    covered = {n for run in runs for n in run["parameters"]}
    assert covered == set(expected)  # every parameter is some rank's
    assert_workers_agree(runs)


@pytest.mark.launch
def test_4bit_syncs_at_tensor_parallel_two_leave_the_shards_bit_identical_across_workers(results):
    runs = [load(results, "tensor2_4bit", rank) for rank in range(4)]
    assert_workers_agree(runs)
    for t in range(2):  # ranks t and 2 + t hold the same tensor shard
        first, second = runs[t]["parameters"], runs[2 + t]["parameters"]
        assert all(torch.equal(first[n][0], second[n][0]) for n in first)


@pytest.mark.parametrize("case", ["pipeline_engine_k2", "pipeline_engine_k1"])
@pytest.mark.launch
def test_deepspeeds_pipeline_engine_is_refused_with_one_line_on_every_rank(results, case):
    for rank in range(4):  # (and the launch ends cleanly: no outer loop was left running)
        error = load(results, case, rank)["error"]
        assert error is not None and "pipeline engine" in error and "examples/megatron_muloco.py" in error, error


# -- the world and the user's model-parallel groups, in one process of a fake world ----------------

@contextmanager
def fake_world(rank: int, world: int):
    """This process as `rank` of a `world`-rank job (torch's fake backend: groups, no traffic)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class LegacyMegatronMpu:
    """A Megatron-DeepSpeed-style mpu (legacy Megatron's rank order: the pipeline stage slowest)."""

    def __init__(self, tensor: int, pipeline: int):
        import torch.distributed as dist

        world, rank = dist.get_world_size(), dist.get_rank()
        self.tensor, self.pipeline = tensor, pipeline
        tensor_groups = [list(range(i, i + tensor)) for i in range(0, world, tensor)]
        pipeline_groups = [list(range(i, world, world // pipeline)) for i in range(world // pipeline)]
        self.groups = {}
        for name, groups in (("tensor", tensor_groups), ("pipeline", pipeline_groups)):
            for ranks in groups:
                group = dist.new_group(ranks)
                if rank in ranks:
                    self.groups[name] = group

    def get_tensor_model_parallel_world_size(self):
        return self.tensor

    def get_pipeline_model_parallel_world_size(self):
        return self.pipeline

    def get_tensor_model_parallel_group(self):
        return self.groups["tensor"]

    def get_pipeline_model_parallel_group(self):
        return self.groups["pipeline"]

    def get_model_parallel_group(self):
        return None


def test_megatron_core_groups_in_tp_pp_dp_order_make_the_workers():
    from megatron.core import parallel_state as mps

    with fake_world(rank=13, world=16):  # K=2 x D=2 x P=2 x T=2: rank 13 = worker 1, d=1, p=0, t=1
        mps.initialize_model_parallel(2, 2, order="tp-pp-dp", create_gloo_process_groups=False)
        try:
            workers = data_parallel_workers(2, mps)
            sizes, coords = workers.topology.sizes, workers.topology.coords
            assert (sizes.workers, sizes.data, sizes.pipeline, sizes.tensor) == (2, 2, 2, 2)
            assert (coords.worker, coords.data, coords.pipeline, coords.tensor) == (1, 1, 0, 1)
            assert workers.data_parallel_ranks == [9, 13]  # its shard's replicas in worker 1 (ranks 8-15)
            mpu = workers.mpu
            assert mpu.get_data_parallel_world_size() == 2 and mpu.get_data_parallel_rank() == 1
            assert mpu.get_data_parallel_group_ranks() == [9, 13]
            assert mpu.get_tensor_model_parallel_group() is mps.get_tensor_model_parallel_group()
            assert mpu.get_pipeline_model_parallel_group() is mps.get_pipeline_model_parallel_group()
            assert mpu.get_model_parallel_world_size() == 4 and mpu.get_model_parallel_rank() == 1
            with pytest.raises(ConfigError, match="tensor=4 but the mpu's is 2"):
                data_parallel_workers(2, mps, tensor=4)
        finally:
            mps.destroy_model_parallel()


@pytest.mark.parametrize("make_mpu, message", [
    (lambda: LegacyMegatronMpu(2, 2), r"rank 5's pipeline group is ranks \[1, 5\], not \[5, 7\]: .*order=\"tp-pp-dp\""),
    (None, "world size 8 is not divisible by workers x pipeline x tensor = 3 x 1 x 2"),
])
def test_groups_that_do_not_make_contiguous_workers_are_one_config_error(make_mpu, message):
    with fake_world(rank=5, world=8):
        with pytest.raises(ConfigError, match=message):
            if make_mpu is None:
                data_parallel_workers(3, tensor=2)
            else:
                data_parallel_workers(2, make_mpu())


def test_groups_built_from_t_and_p_answer_deepspeeds_model_parallel_questions():
    import torch.distributed as dist

    with fake_world(rank=6, world=8):  # K=2 x D=1 x P=2 x T=2: rank 6 = worker 1, p=1, t=0
        mpu = data_parallel_workers(2, tensor=2, pipeline=2).mpu
        assert dist.get_process_group_ranks(mpu.get_tensor_model_parallel_group()) == [6, 7]
        assert dist.get_process_group_ranks(mpu.get_pipeline_model_parallel_group()) == [4, 6]
        assert dist.get_process_group_ranks(mpu.get_model_parallel_group()) == [4, 5, 6, 7]
        assert dist.get_process_group_ranks(mpu.get_data_parallel_group()) == [6]
        assert (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()) == (0, 1)
