"""DistributedMuon (owners gather, orthogonalize and return only pieces, in bf16 or fp32; Newton-Schulz in
either form; momentum in fp32 or bf16) equals single-process Muon on the whole logical matrices at
T x D = 4x1, 2x2, 1x4, and the bytes its
collectives send, counted at muloco.core.comm's calls, equal trainer.optim.muon_comm_model's formula on
every rank. One torchrun launch (4 ranks, gloo); tests/_distributed_muon_worker.py does the work."""
import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

from trainer.model.presets import PRESETS
from trainer.optim.muon_comm_model import MuonExchange, grad_allreduce_bytes

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = REPO_ROOT / "tests" / "_distributed_muon_worker.py"
LAUNCH_TIMEOUT_S = 180
# fp32: reduction-order noise (~1.5e-7 measured). bf16: both sides run the same bf16 Newton-Schulz
# on the same bf16-rounded input, so the gap stays at the fp32 update noise too (~2e-7 measured);
# the bound is bf16's rounding of one run. A wrong piece or per-shard Newton-Schulz gives O(1).
RTOL = {"float32": 1e-6, "bfloat16": 2 ** -8}


def _hidden_matrices(shape) -> tuple[list[str], list[tuple[int, int]]]:
    """Names and full shapes of a preset's fused QKV, O, fused gate-up and down matrices (MHA)."""
    h, f = shape.hidden_size, shape.ffn_hidden_size
    per_layer = (("self_attention.linear_qkv.weight", (3 * h, h)), ("self_attention.linear_proj.weight", (h, h)),
                 ("mlp.linear_fc1.weight", (2 * f, h)), ("mlp.linear_fc2.weight", (h, f)))
    return ([f"decoder.layers.{layer}.{name}" for layer in range(shape.num_layers) for name, _ in per_layer],
            [s for _ in range(shape.num_layers) for _, s in per_layer])


@cache
def _launch(out_dir: Path) -> list[list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(WORKER),
         str(out_dir)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert result.returncode == 0, f"worker failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> list[dict]:
    return [case | {"rank": r} for r, rank_cases in enumerate(_launch(tmp_path_factory.mktemp("dmuon")))
            for case in rank_cases]


@pytest.mark.launch
def test_equals_single_process_muon_per_logical_matrix(cases):
    assert {(c["T"], c["D"], c["ns_dtype"], c["ns_form"], c["momentum_dtype"]) for c in cases} == {
        (t, d, *case) for t, d in [(4, 1), (2, 2), (1, 4)]
        for case in (("float32", "auto", "float32"), ("bfloat16", "gram", "bfloat16"))}
    assert all(c["buckets"] > 1 for c in cases), "the overlapped next-bucket gather was not exercised"
    failures = [c for c in cases if c["max_relative_gap"] > RTOL[c["ns_dtype"]]]
    assert not failures, failures


@pytest.mark.launch
def test_counted_bytes_equal_the_formula_on_every_rank(cases):
    for c in cases:
        assert c["counted_bytes"] > 0, c
        assert c["counted_bytes"] == c["predicted_bytes"], c
    # bf16 pieces halve the traffic of fp32 ones, rank by rank.
    by_key = {(c["rank"], c["T"], c["D"], c["ns_dtype"]): c["counted_bytes"] for c in cases}
    for (rank, t, d, dtype), nbytes in by_key.items():
        if dtype == "bfloat16":
            assert 2 * nbytes == by_key[(rank, t, d, "float32")]


def test_no_rank_sends_more_than_the_gradient_all_reduce_at_t2_d2():
    """At 150m shapes (hidden matrices only), bf16 Muon traffic is half of the fp32 ring all-reduce
    of the same matrices' gradients, and fp32 equal to it: 2(T-1)/(TD) + (D-1)/D of the local size."""
    shape = PRESETS["150m"]
    names, shapes = _hidden_matrices(shape)
    exchange = MuonExchange.build(names, shapes, shape, tp=2, dp=2, ns_steps=5, bucket_numel=1 << 28)
    local = sum(torch.Size(s).numel() for s in shapes) // 2
    grads = grad_allreduce_bytes(local, dp=2)
    assert exchange.max_bytes_sent(element_size=2).total <= 0.55 * grads
    assert exchange.max_bytes_sent(element_size=4).total <= 1.1 * grads


def test_exchange_plan_is_complete_and_balanced_per_bucket():
    """Every matrix has one owner among the T x D ranks; within a bucket no owner gets a second
    matrix while another owner has none; slots add up to every matrix's pieces exactly once."""
    shape = PRESETS["150m"]
    names, shapes = _hidden_matrices(shape)
    x = MuonExchange.build(names, shapes, shape, tp=2, dp=2, ns_steps=5, bucket_numel=4 * 1024 * 1024)
    assert len(x.buckets) > 1 and sorted(i for b in x.buckets for i in b) == list(range(len(names)))
    assert set(x.owners) == set(range(4))
    for b in range(len(x.buckets)):
        owned = [len(x.owned(b, d, t)) for d in range(2) for t in range(2)]
        assert sum(owned) == len(x.matrices_in(b))
        assert max(owned) <= 1 or min(owned) >= 1
        assert sum(x.slot_numel(b, d) for d in range(2)) == x.pieces_numel(x.matrices_in(b))
    local = [torch.Size(s).numel() // 2 for s in shapes]
    assert x.for_local_shards(names, [(s[0] // 2, s[1]) if "fc2" not in n and "proj" not in n else (s[0], s[1] // 2)
                                      for n, s in zip(names, shapes)], shape, 2, 2, 5, 4 * 1024 * 1024) == x
    assert 0 < x.max_transient_bytes(2, 2, local, nesterov=True)
