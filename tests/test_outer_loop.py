"""The MuLoCo outer loop end to end (issue 5): identities of the algorithm on real multi-process CPU
trainings, the NaN/outlier guard, streaming with overlap, and the CLI run (whose sync bytes are
tools/plan.py's).

Start-up dominates on CPU, so tests/_outer_probe.py runs several short trainings per launch: two
2-rank and two 4-rank launches serve every identity; the CLI test is one more launch.
The references are inner-only training, the K=1 run, and the outer step computed here in float64
from the weights the workers held just before a sync.
"""
import json
import math
from functools import cache
from pathlib import Path

import pytest
import torch

from tools import plan as planner
from tools.planning.plan import make_plan
from _probe_common import load_rank_dumps, worker_weights
from tools.synthetic_data import write_markov_dataset
from tools.trainer_runs import PRETRAIN, LaunchResult, launch_ranks, read_metrics, shared_memory_files
from tools.trainer_runs import REPO_ROOT

PROBE = REPO_ROOT / "tests" / "_outer_probe.py"
MULOCO_CONFIG = REPO_ROOT / "ds_configs" / "cpu_tiny_muloco.json"
VOCAB = 1000
H = 3  # sync interval of the identity runs: syncs after steps 3 and 6
STEPS = 6
# Runs that differ only in fp32 reduction order (TP all-reduce, D=2 gradient average, g - (g - l)):
# per tensor, ||a - b|| <= WEIGHT_RTOL ||b||. Not elementwise: AdamW's update of an entry whose
# gradient is ~0 (a token never seen) flips with the sign of that gradient's rounding noise.
# A wrong outer or inner step moves weights by ~1e-2 of their norm.
WEIGHT_RTOL = 1e-4
LOSS_TOL = dict(rtol=1e-5, atol=0.0)
FP32_NOISE = 1e-5  # largest entry difference fp32 reduction order makes in these runs' weights
FLIP_FRACTION = 0.005  # observed: at most 0.05% of a tensor's entries flip a bin at the first sync
OUTER = dict(outer_lr=0.7, outer_momentum=0.6, nesterov=True)
FOUR_BIT_EF = {"method": "statistical", "bits": 4, "error_feedback": True}
# The official forms at 2 bits (compression.py): paper EF at outer lr 0.5 is plain EF at 0.25.
TWO_BIT_OFFICIAL = {"method": "statistical", "bits": 2, "error_feedback": True, "ef_beta": 0.9,
                    "statistical_rounding": "paper"}


def inner_only_config() -> dict:
    return {k: v for k, v in json.loads(MULOCO_CONFIG.read_text()).items() if k != "muloco"}


def muloco_config(**block) -> dict:
    return {**inner_only_config(),
            "muloco": {"workers": 2, "sync_interval": H, **OUTER, "compression": {"method": "none"}, **block}}


def case(name: str, ds_config: dict, data: str, *flags, steps: int = STEPS, **extra) -> dict:
    args = ["--model", "tiny", "--data-path", data, "--vocab-size", str(VOCAB), "--seq-length", "64",
            "--train-iters", str(steps), "--eval-interval", "0", "--log-interval", "1", *flags]
    return {"name": name, "ds_config": ds_config, "args": args, **extra}


def k1_identity_cases(data: str) -> list[dict]:
    return [
        # K=1 on 2 ranks is D=2 inner replicas, so the outer state's ownership split runs here too.
        case("inner_only", inner_only_config(), data, "--micro-batch-size", "2"),
        case("k1_noop_outer", muloco_config(workers=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False), data,
             "--micro-batch-size", "2"),
        case("k1", muloco_config(workers=1), data, "--micro-batch-size", "2", read_as_worker_of=2),
        case("k2_identical_data", muloco_config(identical_worker_data=True), data),
    ]


def k2_cases(data: str) -> list[dict]:
    return [
        case("k2", muloco_config(), data),
        case("k2_4bit", muloco_config(compression=FOUR_BIT_EF), data),
        case("k2_2bit_paper_ef", muloco_config(outer_lr=0.5, compression={**TWO_BIT_OFFICIAL, "ef_form": "paper"}), data),
        case("k2_2bit_plain_ef", muloco_config(outer_lr=0.25, compression={**TWO_BIT_OFFICIAL, "ef_form": "plain"}), data),
        # F=2 fragments of H=4: fragment 0 launches after steps 2, 6, fragment 1 after step 4; tau=1.
        case("k2_streaming", muloco_config(sync_interval=4, collective="reduce_scatter", compression=FOUR_BIT_EF,
                                           streaming={"fragments": 2, "overlap_steps": 1}), data, steps=7),
    ]


def tensor_parallel_cases(data: str) -> list[dict]:
    return [
        case("k2_t2", muloco_config(), data, "--tensor-model-parallel-size", "2"),
        case("k2_t2_4bit", muloco_config(compression=FOUR_BIT_EF), data, "--tensor-model-parallel-size", "2"),
        # Only worker 1's first tensor rank is poisoned: its ballot reaches its TP peer through the
        # worker's sum and the other worker through the exchange's header.
        case("k2_poisoned", muloco_config(), data, "--tensor-model-parallel-size", "2", steps=3 * H,
             poison={"worker": 1, "tensor_rank": 0, "at": {str(H): "nan", str(2 * H): "outlier"}}),
    ]


def pipeline_and_data_parallel_cases(data: str) -> list[dict]:
    return [
        case("k2_p2", muloco_config(), data, "--pipeline-model-parallel-size", "2"),
        case("k2_p2_4bit", muloco_config(compression=FOUR_BIT_EF), data, "--pipeline-model-parallel-size", "2"),
        case("k2_d2_4bit", muloco_config(compression=FOUR_BIT_EF), data, "--micro-batch-size", "2"),
    ]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("outer_loop")
    write_markov_dataset(str(path / "markov"), vocab_size=VOCAB)
    return path


# Each launch stays well inside the harness's 300 s timeout on a busy 2-core machine.
LAUNCHES = {"k1_identities": (2, k1_identity_cases), "k2": (2, k2_cases), "tensor_parallel": (4, tensor_parallel_cases),
            "pipeline_and_data_parallel": (4, pipeline_and_data_parallel_cases)}


@cache
def _probe(workdir: Path, launch: str) -> tuple[Path, LaunchResult]:
    """Each launch runs once per session; a failed one fails every test that reads it, with its output."""
    ranks, cases = LAUNCHES[launch]
    out = workdir / launch
    out.mkdir()
    (out / "cases.json").write_text(json.dumps(cases(str(workdir / "markov"))))
    return out, launch_ranks(PROBE, ranks, [str(out / "cases.json"), str(out)])


def case_dir(workdir: Path, name: str) -> Path:
    launch = next(launch for launch, (_, cases) in LAUNCHES.items() if name in {c["name"] for c in cases("")})
    out, result = _probe(workdir, launch)
    result.check(f"outer probe {launch}")
    return out / name


def dumps(workdir: Path, name: str) -> list[dict]:
    return load_rank_dumps(case_dir(workdir, name))


def outer_records(workdir: Path, name: str) -> list[dict]:
    return [r for r in read_metrics(case_dir(workdir, name) / "run") if "outer_step" in r]


def worker_losses(run: list[dict], worker: int) -> list[float]:
    """Per-step loss of one worker: the mean over its inner-DP replicas' last-stage losses."""
    per_replica = [d["losses"] for d in run if d["coords"]["worker"] == worker and d["coords"]["tensor"] == 0
                   and d["losses"]]
    steps = sorted(per_replica[0])
    return [sum(r[s] for r in per_replica) / len(per_replica) for s in steps]


def sync_steps(run: list[dict]) -> list[int]:
    return sorted(int(label.split("@")[1]) for label in run[0]["snapshots"] if label.startswith("post@"))


def assert_same_weights(actual: dict, expected: dict, what: str, rtol: float = WEIGHT_RTOL) -> None:
    assert actual.keys() == expected.keys(), what
    for name, b in expected.items():
        a = actual[name].to(b.dtype)
        error, norm = float((a - b).norm()), float(b.norm())
        assert error <= rtol * norm, f"{what}, {name}: ||diff|| {error:.3g} is over {rtol:g} x ||expected|| {norm:.3g}"


def assert_same_run(actual: list[dict], expected: list[dict], workers: int) -> None:
    """Step-for-step losses and final weights of every worker, to fp32 tolerance."""
    for k in range(workers):
        torch.testing.assert_close(worker_losses(actual, k), worker_losses(expected, k), **LOSS_TOL,
                                   msg=lambda m: f"worker {k} losses: {m}")
        assert_same_weights(worker_weights(actual, k, "final"), worker_weights(expected, k, "final"),
                            f"worker {k} final weights")


def assert_same_compressed_run(actual: list[dict], expected: list[dict], workers: int) -> None:
    """Quantization is discontinuous: fp32 noise moves an entry that sits on a bin edge by one bin
    (~1e-4 here), and later inner steps spread those flips. So: losses step for step; right after the
    first sync, all but FLIP_FRACTION of each tensor's entries within fp32 noise (a quantization group
    that depended on the parallel layout would change nearly all of them). Final weights differ by
    the spread flips (~2e-3 of a small matrix's norm), so the losses carry the rest of the run."""
    first = f"post@{sync_steps(expected)[0]}"
    for k in range(workers):
        torch.testing.assert_close(worker_losses(actual, k), worker_losses(expected, k), **LOSS_TOL,
                                   msg=lambda m: f"worker {k} losses: {m}")
        a, b = worker_weights(actual, k, first), worker_weights(expected, k, first)
        for name in b:
            flipped = float(((a[name] - b[name]).abs() > FP32_NOISE).float().mean())
            assert flipped <= FLIP_FRACTION, f"worker {k} {name} after the first sync: {flipped:.2%} of entries differ"


@pytest.mark.launch
def test_k1_with_outer_lr_1_and_no_momentum_is_inner_only_training(workdir):
    outer, plain = dumps(workdir, "k1_noop_outer"), dumps(workdir, "inner_only")
    assert sync_steps(outer) == [H, 2 * H]  # the hook did sync
    assert_same_run(outer, plain, workers=1)


@pytest.mark.launch
def test_k2_with_identical_worker_data_reproduces_k1(workdir):
    k1, k2 = dumps(workdir, "k1"), dumps(workdir, "k2_identical_data")
    assert sync_steps(k2) == [H, 2 * H]
    for worker in (0, 1):  # each worker of the K=2 run is the K=1 run
        torch.testing.assert_close(worker_losses(k2, worker), worker_losses(k1, 0), **LOSS_TOL)
        assert_same_weights(worker_weights(k2, worker, "final"), worker_weights(k1, 0, "final"),
                            f"K=2 worker {worker} vs K=1")


@pytest.mark.launch
def test_uncompressed_outer_step_is_nesterov_sgd_on_the_plain_average(workdir):
    """theta <- theta - lr (avg + mu m), m <- mu m + avg, avg = mean_k (theta - theta_k), in float64."""
    run = dumps(workdir, "k2")
    theta = {n: t.double() for n, t in worker_weights(run, 0, "init").items()}
    momentum = {n: torch.zeros_like(t) for n, t in theta.items()}
    lr, mu = OUTER["outer_lr"], OUTER["outer_momentum"]
    assert sync_steps(run) == [H, 2 * H]
    for step in sync_steps(run):
        local = [worker_weights(run, k, f"pre@{step}") for k in (0, 1)]
        for name in theta:
            avg = sum(theta[name] - w[name].double() for w in local) / 2
            momentum[name] = mu * momentum[name] + avg
            theta[name] = theta[name] - lr * (avg + mu * momentum[name])
        for k in (0, 1):
            assert_same_weights(worker_weights(run, k, f"post@{step}"), theta,
                                f"worker {k} after the sync at step {step}", rtol=1e-7)


@pytest.mark.parametrize("name", ["k2", "k2_4bit", "k2_identical_data", "k2_poisoned", "k2_t2_4bit", "k2_p2_4bit",
                                  "k2_d2_4bit"])
@pytest.mark.launch
def test_every_rank_holds_bit_identical_shards_after_every_sync(workdir, name):
    """Rank r of worker 0 and the ranks holding the same shard in worker 1 (and, with D=2, in every
    inner replica) hold the same bits after each sync."""
    run = dumps(workdir, name)
    assert sync_steps(run)
    for step in sync_steps(run):
        by_position = {}
        for d in run:
            c = d["coords"]
            by_position.setdefault((c["pipeline"], c["tensor"]), []).append(d["snapshots"][f"post@{step}"])
        for position, states in by_position.items():
            for other in states[1:]:
                for param, value in states[0].items():
                    assert torch.equal(other[param], value), f"{name}: {param} at {position} differs after step {step}"


@pytest.mark.parametrize("name, reference", [("k2_t2", "k2"), ("k2_p2", "k2")])
@pytest.mark.launch
def test_parallelism_inside_a_worker_does_not_change_the_run(workdir, name, reference):
    assert_same_run(dumps(workdir, name), dumps(workdir, reference), workers=2)


@pytest.mark.parametrize("name", ["k2_t2_4bit", "k2_p2_4bit", "k2_d2_4bit"])
@pytest.mark.launch
def test_parallelism_inside_a_worker_does_not_change_a_compressed_run(workdir, name):
    assert_same_compressed_run(dumps(workdir, name), dumps(workdir, "k2_4bit"), workers=2)


@pytest.mark.launch
def test_compressed_sync_sends_fewer_bytes_and_changes_the_result(workdir):
    plain, compressed = outer_records(workdir, "k2"), outer_records(workdir, "k2_4bit")
    assert [r["compression_error"] for r in plain] == [0.0, 0.0]
    assert all(0 < r["compression_error"] < 0.5 for r in compressed)
    # Everything at 4 bits; tiny's 128-long rows carry 16-entry fp16 codebooks.
    assert all(c["bytes_sent_per_rank"] < plain[0]["bytes_sent_per_rank"] / 2 for c in compressed)
    final = worker_weights(dumps(workdir, "k2_4bit"), 0, "final")
    exact = worker_weights(dumps(workdir, "k2"), 0, "final")
    assert any(float((final[n] - exact[n]).norm()) > WEIGHT_RTOL * float(exact[n].norm()) for n in final)


@pytest.mark.launch
def test_paper_error_feedback_is_plain_error_feedback_at_the_squared_outer_lr(workdir):
    """ef_form "paper" sends e = beta e + lr delta and steps its average at lr again: at lr 0.5 (scaling
    by it is exact in fp32) the run is bit for bit the plain-EF run at lr 0.25."""
    paper, plain = dumps(workdir, "k2_2bit_paper_ef"), dumps(workdir, "k2_2bit_plain_ef")
    assert sync_steps(paper) == [H, 2 * H]
    for k in (0, 1):
        assert worker_losses(paper, k) == worker_losses(plain, k)
        for label in (f"post@{H}", f"post@{2 * H}", "final"):
            a, b = worker_weights(paper, k, label), worker_weights(plain, k, label)
            assert all(torch.equal(a[n], b[n]) for n in b), f"worker {k} {label}"
    errors = [[r["compression_error"] for r in outer_records(workdir, name)]
              for name in ("k2_2bit_paper_ef", "k2_2bit_plain_ef")]
    assert errors[0] == errors[1] and all(0 < e < 1 for e in errors[0])


@pytest.mark.launch
def test_nonfinite_or_outlier_worker_skips_the_sync_for_everyone_and_training_goes_on(workdir):
    run = dumps(workdir, "k2_poisoned")
    init = {k: worker_weights(run, k, "init") for k in (0, 1)}
    assert not all(torch.isfinite(t).all() for t in worker_weights(run, 1, f"pre@{H}").values())  # poisoned
    for step in (H, 2 * H):  # both syncs skipped: every worker restarts from the initial global weights
        for k in (0, 1):
            assert_same_weights(worker_weights(run, k, f"post@{step}"), init[k], f"worker {k} after step {step}",
                                rtol=0.0)
    records = outer_records(workdir, "k2_poisoned")
    assert [r["step"] for r in records] == [H, 2 * H, 3 * H]
    assert all(r["round_trips"] == 1 for r in records)  # the vote needs no round trip of its own
    assert "non-finite" in records[0]["skipped"]
    assert "worker 1" in records[1]["skipped"] and "norm" in records[1]["skipped"]
    assert "skipped" not in records[2] and records[2]["outer_step"] == 1
    for k in (0, 1):
        losses = worker_losses(run, k)
        assert len(losses) == 3 * H and all(map(math.isfinite, losses))
        final = worker_weights(run, k, "final")
        assert all(torch.isfinite(t).all() for t in final.values())
        assert any(not torch.equal(final[n], init[k][n]) for n in final)  # the third sync applied


def first_fragment(name: str) -> bool:
    """Fragment 0 of the tiny model (4 layers) cut in F=2: the embedding and layers 0-1."""
    parts = name.split(".")
    return "embedding" in parts or ("layers" in parts and int(parts[parts.index("layers") + 1]) < 2)


@pytest.mark.launch
def test_streaming_fragments_sync_in_turn_with_overlap_over_reduce_scatter(workdir):
    run = dumps(workdir, "k2_streaming")
    # Launched after steps 2 (fragment 0), 4 (fragment 1), 6 (fragment 0); applied one step later. At the
    # last step (7) fragment 1, moved since its sync landed at step 5, syncs once more (the final sync).
    assert sync_steps(run) == [3, 5, 7]
    for step, synced in ((3, {True}), (5, {False}), (7, {True, False})):  # whether the first fragment's
        w0, w1 = (worker_weights(run, k, f"post@{step}") for k in (0, 1))
        for name in w0:
            same = torch.equal(w0[name], w1[name])
            assert same == (first_fragment(name) in synced), f"{name} after step {step}: identical={same}"
    records = outer_records(workdir, "k2_streaming")
    assert [(r["fragment"], r["step"], r.get("final_sync", False)) for r in records] == [
        (0, 2, False), (1, 4, False), (0, 6, False), (1, 7, True)]
    for k in (0, 1):
        losses = worker_losses(run, k)
        assert all(map(math.isfinite, losses)) and losses[-1] < losses[0] - 0.3


@pytest.mark.launch
def test_cli_k2_t2_four_bit_error_feedback_run_learns_and_logs_outer_syncs(workdir):
    run_dir = workdir / "cli"
    launch = launch_ranks(PRETRAIN, 4, [
        "--ds_config", str(MULOCO_CONFIG), "--model", "tiny", "--data-path", str(workdir / "markov"),
        "--vocab-size", str(VOCAB), "--train-iters", "40", "--tensor-model-parallel-size", "2",
        "--eval-interval", "10", "--eval-iters", "2", "--run-dir", str(run_dir)]).check("the CLI run")
    # DeepSpeed's CPU all-reduce buffers (one /dev/shm file per rank) are gone with the run.
    assert not shared_memory_files(launch.master_port)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["muloco"]["workers"] == 2 and config["tensor_parallel"] == 2
    records = read_metrics(run_dir)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 4 and val[-1] < val[0] - 0.5 and val == sorted(val, reverse=True)
    syncs = [r for r in records if "outer_step" in r]
    assert [r["step"] for r in syncs] == [10, 20, 30, 40] and [r["outer_step"] for r in syncs] == [1, 2, 3, 4]
    for r in syncs:
        assert "skipped" not in r
        assert r["pseudograd_norm"] > 0 and 0 < r["pseudograd_cosine"] <= 1
        assert r["bytes_sent_per_rank"] > 0 and 0 < r["compression_error"] < 0.5 and r["sync_seconds"] > 0
        assert (r["round_trips"], r["background_round_trips"]) == (1, 1)  # all-gather with the vote; metrics
    # tools/plan.py prices each sync by the bytes the trainer's collectives send (here an all-gather at T=2).
    plan = make_plan(planner.inputs_from_args(planner.build_parser().parse_args([
        "--model", "tiny", "--seq-length", "128", "--vocab-size", str(VOCAB), "--tensor-model-parallel-size", "2",
        "--data", "1", "--global-batch-size", "8", "--micro-batch-size", "4", "--ds_config", str(MULOCO_CONFIG)])))
    assert {r["bytes_sent_per_rank"] for r in syncs} == {plan.sync.per_rank_mean}
    assert plan.sync.per_rank_max >= plan.sync.per_rank_mean


@pytest.mark.parametrize("block, message", [
    ({"outer_backend": "mpi"}, "muloco.outer_backend"),
    ({"compression": {"method": "statistical", "embedding_bits": 16}}, "embedding_bits"),
])
def test_bad_outer_settings_are_one_config_error(block, message):
    from muloco.diloco.config import MuLoCoConfig
    from muloco.core.errors import ConfigError
    from muloco.core.typed_json import load

    with pytest.raises(ConfigError, match=message):
        load(MuLoCoConfig, block, "muloco")
