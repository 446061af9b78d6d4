"""The K x D x P x T process topology: sizes from the world, rank <-> coordinates, the inner-DP,
outer and worker groups (against hand-computed lists and Megatron's own rank generator), and one
clear message for every impossible size, as the run resolves its configuration."""
import json

import pytest
from megatron.core.parallel_state import RankGenerator

from trainer.config import ConfigError, build_parser, resolve
from trainer.engine import deepspeed_config
from muloco.core.topology import (ParallelSizes, RankCoordinates, TopologyError, coordinates, inner_data_parallel_ranks,
                              outer_ranks, rank_of, worker_ranks)

K2D2P2T2 = ParallelSizes(workers=2, data=2, pipeline=2, tensor=2)


def test_from_world_rejects_every_bad_size_at_once():
    with pytest.raises(TopologyError, match=r"^workers \(K\) must be >= 1, got 0; pipeline-model-parallel-size "
                                            r"must be >= 1, got -1$"):
        ParallelSizes.from_world(8, workers=0, pipeline=-1, tensor=1)


def test_from_world_derives_inner_data_parallel():
    assert ParallelSizes.from_world(16, workers=2, pipeline=2, tensor=2) == K2D2P2T2
    assert ParallelSizes.from_world(4, workers=1, pipeline=1, tensor=1) == ParallelSizes(1, 4, 1, 1)
    assert K2D2P2T2.world == 16 and K2D2P2T2.ranks_per_worker == 8


@pytest.mark.parametrize("sizes", [K2D2P2T2, ParallelSizes(3, 1, 2, 2), ParallelSizes(1, 3, 1, 4),
                                   ParallelSizes(2, 1, 1, 1)])
def test_coordinates_round_trip(sizes):
    seen = set()
    for rank in range(sizes.world):
        c = coordinates(rank, sizes)
        assert rank_of(c, sizes) == rank
        assert (0 <= c.worker < sizes.workers and 0 <= c.data < sizes.data and 0 <= c.pipeline < sizes.pipeline
                and 0 <= c.tensor < sizes.tensor)
        seen.add(c)
    assert len(seen) == sizes.world


def test_rank_order_is_worker_slowest_tensor_fastest():
    assert coordinates(0, K2D2P2T2) == RankCoordinates(0, 0, 0, 0)
    assert coordinates(1, K2D2P2T2) == RankCoordinates(0, 0, 0, 1)
    assert coordinates(2, K2D2P2T2) == RankCoordinates(0, 0, 1, 0)
    assert coordinates(4, K2D2P2T2) == RankCoordinates(0, 1, 0, 0)
    assert coordinates(13, K2D2P2T2) == RankCoordinates(1, 1, 0, 1)


def test_groups_k2_d2_p2_t2():
    assert inner_data_parallel_ranks(K2D2P2T2) == [[0, 4], [1, 5], [2, 6], [3, 7],
                                                   [8, 12], [9, 13], [10, 14], [11, 15]]
    assert outer_ranks(K2D2P2T2) == [[r, r + 8] for r in range(8)]
    assert worker_ranks(K2D2P2T2) == [list(range(8)), list(range(8, 16))]


@pytest.mark.parametrize("sizes", [K2D2P2T2, ParallelSizes(3, 2, 1, 2), ParallelSizes(2, 1, 2, 1)])
def test_groups_agree_with_megatron(sizes):
    """Megatron (order tp-pp-dp, its DP spanning all K*D replicas) must build the same TP and PP
    groups, and its DP groups must be the unions over workers of our inner-DP groups."""
    megatron = RankGenerator(tp=sizes.tensor, ep=1, dp=sizes.workers * sizes.data, pp=sizes.pipeline, cp=1,
                             order="tp-pp-dp")
    tp = sorted(sorted(rank_of(RankCoordinates(k, d, p, t), sizes) for t in range(sizes.tensor))
                for k in range(sizes.workers) for d in range(sizes.data) for p in range(sizes.pipeline))
    pp = sorted(sorted(rank_of(RankCoordinates(k, d, p, t), sizes) for p in range(sizes.pipeline))
                for k in range(sizes.workers) for d in range(sizes.data) for t in range(sizes.tensor))
    assert sorted(megatron.get_ranks("tp")) == tp
    assert sorted(megatron.get_ranks("pp")) == pp
    inner = inner_data_parallel_ranks(sizes)
    for group in megatron.get_ranks("dp"):
        mine = [g for g in inner if g[0] in group]
        assert len(mine) == sizes.workers and sorted(r for g in mine for r in g) == sorted(group)
    for groups in (inner, outer_ranks(sizes), worker_ranks(sizes)):  # each kind partitions the world
        assert sorted(r for g in groups for r in g) == list(range(sizes.world))


def _resolve(tmp_path, world: int, *flags: str, workers: int | None = None):
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "adamw", "params": {"lr": 1e-3}}}
    if workers is not None:
        ds["muloco"] = {"workers": workers}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return resolve(build_parser().parse_args(["--ds_config", str(path), "--model", "tiny", *flags]), world)


def test_resolve_accepts_a_good_layout(tmp_path):
    config = _resolve(tmp_path, 8, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2")
    assert (config.tensor_parallel, config.pipeline_parallel, config.batch.data_parallel) == (2, 2, 2)
    assert deepspeed_config(config.ds_config, config.batch)["train_batch_size"] == 4  # micro 2 x D 2: what DeepSpeed checks


def test_resolve_accepts_uneven_pipeline_stages(tmp_path):
    # 4 layers over 3 stages: Megatron's uneven split, 1 + 2 + 1 (trainer.model.stages).
    config = _resolve(tmp_path, 3, "--pipeline-model-parallel-size", "3")
    assert config.pipeline_parallel == 3


@pytest.mark.parametrize("world, flags, workers, message", [
    (6, ["--tensor-model-parallel-size", "4"], None,
     r"world size 6 is not divisible by workers x pipeline x tensor = 1 x 1 x 4 = 4"),
    (8, ["--pipeline-model-parallel-size", "2"], 3,
     r"world size 8 is not divisible by workers x pipeline x tensor = 3 x 2 x 1 = 6"),
    (4, [], 0, r"workers.* must be >= 1, got 0"),
    (4, ["--tensor-model-parallel-size", "0"], None, r"tensor-model-parallel-size must be >= 1, got 0"),
    (4, ["--tensor-model-parallel-size", "4", "--num-attention-heads", "6", "--num-query-groups", "6"], None,
     r"^num-attention-heads 6 is not divisible by tensor-model-parallel-size 4; "
     r"num-query-groups 6 is not divisible by tensor-model-parallel-size 4$"),
    (4, ["--tensor-model-parallel-size", "4"], None,
     r"^num-query-groups 2 is not divisible by tensor-model-parallel-size 4$"),
    (5, ["--pipeline-model-parallel-size", "5"], None,
     r"^num-layers 4 cannot be split over pipeline-model-parallel-size 5 \(every stage needs at least one layer\)$"),
    (2, ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "351"], None,
     r"^ffn-hidden-size 351 is not divisible by tensor-model-parallel-size 2$"),
])
def test_every_impossible_size_raises_one_clear_message(tmp_path, world, flags, workers, message):
    # pretrain.py reports exactly these two errors as "configuration error: <message>".
    with pytest.raises((ConfigError, TopologyError), match=message):
        _resolve(tmp_path, world, *flags, workers=workers)
