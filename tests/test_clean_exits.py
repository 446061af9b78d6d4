"""Every failure ends cleanly: ranks die with their launcher (and a second job cannot share the run's
folders), the next job resumes from an intact checkpoint with each step logged once, nothing is left
in /dev/shm, and a rank that cannot load its own rank file says so itself while the others stop
pointing at it. One killed DeepSpeed launch, its successor, and one failing resume (2 ranks each)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _ckpt_runs import REPO_ROOT, Launch, alive, check, dataset, launch
from tools.trainer_runs import shared_memory_files

from trainer.checkpoint import CheckpointReader, latest_iteration
from trainer.checkpoint.format import rank_file, sha256_of
from muloco.core.rank_file import read_rank_file, to_plain, write_rank_file
from trainer.folder_lock import LOCK_FILE, FolderLock, JobLocks

pytestmark = [pytest.mark.launch, pytest.mark.timeout(900)]  # every test here starts processes

TRAIN_ITERS = 10_000  # the first job would train for long after its launcher is killed: orphans would show
SAVE_INTERVAL = 4
ORPHAN_DEADLINE_S = 10


@pytest.fixture(scope="module")
def killed_and_resumed(base, tmp_path_factory) -> dict:
    """A 2-rank job whose DeepSpeed launch.py is SIGKILLed after its first save, then the next job on
    the same folders, resuming and finishing."""
    work = tmp_path_factory.mktemp("killed")
    ckpt, run_dir = work / "ckpt", work / "run"
    first = Launch(base, 2, run_dir, "--save", str(ckpt), "--save-interval", str(SAVE_INTERVAL),
                   train_iters=TRAIN_ITERS, launcher="deepspeed")
    try:
        first.wait_for(f"saved checkpoint {ckpt / f'iter_{SAVE_INTERVAL:07d}'}")
        launcher = first.launcher_pid()
        ranks = [first.rank_pid(r) for r in range(2)]
        os.kill(launcher, signal.SIGKILL)
        killed = time.monotonic()
        while any(map(alive, ranks)) and time.monotonic() - killed < 60:
            time.sleep(0.1)
        orphaned_for = time.monotonic() - killed
        survivors = [pid for pid in ranks if alive(pid)]
    finally:
        first.kill()
    stopped_at = latest_iteration(ckpt)
    end = stopped_at + SAVE_INTERVAL  # the next job stops there (--exit-interval), saving
    second = launch(base, 2, run_dir, "--save", str(ckpt), "--save-interval", str(SAVE_INTERVAL), "--load",
                    str(ckpt), "--train-iters", str(TRAIN_ITERS), "--exit-interval", str(end))
    return {"ckpt": ckpt, "run_dir": run_dir, "orphaned_for": orphaned_for, "survivors": survivors,
            "port": first.port, "stopped_at": stopped_at, "end": end, "second": second}


def test_ranks_die_with_their_killed_launcher_and_leave_no_shared_memory(killed_and_resumed):
    run = killed_and_resumed
    assert run["survivors"] == [], f"ranks {run['survivors']} outlived their launcher"
    assert run["orphaned_for"] < ORPHAN_DEADLINE_S, f"the ranks took {run['orphaned_for']:.1f} s to die"
    assert shared_memory_files(run["port"]) == [], "a killed job left DeepSpeed's /dev/shm files"


def test_the_next_job_resumes_from_an_intact_checkpoint_and_logs_each_step_once(killed_and_resumed):
    run = killed_and_resumed
    second, end = check(run["second"]), run["end"]
    assert f"resumed from {run['ckpt'] / 'iter_{:07d}'.format(run['stopped_at'])} at step" in second.stdout
    assert "taking over the lock of a job that is gone" in second.stdout  # the killed job's rank 0 held it
    assert latest_iteration(run["ckpt"]) == end
    reader = CheckpointReader(run["ckpt"])  # every rank file against its SHA-256
    assert all(reader.rank_state(r)["step"] == end for r in range(2))
    assert not list(run["ckpt"].glob("**/*.tmp.*"))
    steps = [json.loads(line)["step"] for line in (run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, end + 1)), "metrics.jsonl must hold each step once after the resume"
    assert not (run["run_dir"] / LOCK_FILE).exists() and not (run["ckpt"] / LOCK_FILE).exists()


def test_a_rank_that_cannot_load_its_own_file_prints_its_line_and_the_others_point_at_it(killed_and_resumed, base,
                                                                                         tmp_path):
    """The finding: a (128,) tensor under the embedding of rank 1's file, with a matching SHA-256 in
    meta.json, loaded by broadcasting (or, damaged otherwise, only rank 0 spoke and died of gloo)."""
    ckpt, end = tmp_path / "ckpt", killed_and_resumed["end"]
    source = killed_and_resumed["ckpt"] / f"iter_{end:07d}"
    (ckpt / source.name).mkdir(parents=True)
    for path in source.iterdir():
        (ckpt / source.name / path.name).write_bytes(path.read_bytes())
    (ckpt / "latest").write_text(f"{end}\n")
    victim = rank_file(ckpt / source.name, 1)
    state = to_plain(read_rank_file(victim))
    state["model"]["embedding.word_embeddings.weight"] = state["model"]["embedding.word_embeddings.weight"][0].clone()
    with open(victim.with_name("crafted"), "wb") as f:
        write_rank_file(f, state)
    victim.with_name("crafted").replace(victim)
    meta = json.loads((ckpt / source.name / "meta.json").read_text())
    meta["rank_files"][victim.name] = sha256_of(victim)
    (ckpt / source.name / "meta.json").write_text(json.dumps(meta))

    started = time.monotonic()
    result = launch(base, 2, tmp_path / "run", "--load", str(ckpt), "--train-iters", str(TRAIN_ITERS))
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "failed (exitcode: 2)" in output, output[-4000:]  # torchrun's exit is 1
    errors = [line for line in output.splitlines() if "checkpoint error" in line or line.startswith("stopping:")]
    assert errors == [
        f"checkpoint error: rank file {victim}: model.embedding.word_embeddings.weight must be a float32 tensor of "
        "shape (1024, 128), got a float32 tensor of shape (128,)",
        "stopping: rank 1 could not load the checkpoint (see its line above); every rank exits"], output[-4000:]
    assert "Connection closed" not in output, output[-4000:]
    assert f'File "{REPO_ROOT / "trainer"}' not in output, "a rank ended in a traceback"  # (torchrun prints its own)
    assert time.monotonic() - started < 300


# -- in one process: the pieces ----------------------------------------------------------------------

CHILD = textwrap.dedent("""
    import sys, time
    from trainer.parent_watch import ParentWatch
    with ParentWatch(poll_s=0.1, use_kernel=sys.argv[1] == "kernel"):
        print("watching", flush=True)
        time.sleep(60)
""")
PARENT = textwrap.dedent("""
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE, text=True)
    child.stdout.readline()
    print(child.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.parametrize("mode", ["kernel", "poll"])
def test_a_watched_process_ends_when_its_parent_is_killed(mode):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, mode], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child), f"the {mode}-watched child outlived its parent"


def test_a_folder_is_refused_while_its_job_lives_and_taken_over_once_it_is_gone(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from trainer.folder_lock import FolderLock
        assert FolderLock({str(tmp_path)!r}, "--save").acquire() is None
        print("locked", flush=True)
        time.sleep(60)
    """)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert holder.stdout.readline().strip() == "locked"
        problem = JobLocks([("--run-dir", str(tmp_path / "run")), ("--save", str(tmp_path))]).acquire()
        assert problem is not None and problem.startswith(f"--save {tmp_path} is in use by another live job (host ")
        assert f"pid {holder.pid} since " in problem
        assert not (tmp_path / "run" / LOCK_FILE).exists(), "a refused job must not keep the locks it took"
    finally:
        holder.kill()
        holder.wait()
    lock = FolderLock(tmp_path, "--save")
    assert lock.acquire() is None  # the holder was killed: its lock file is stale
    assert f"--save {tmp_path}: taking over the lock of a job that is gone (host " in capsys.readouterr().out
    assert f"pid {os.getpid()} " in (tmp_path / LOCK_FILE).read_text()
    lock.release()
    assert not (tmp_path / LOCK_FILE).exists()


SHUTDOWN_PROBE = textwrap.dedent("""
    import json, sys, threading
    from tools.trainer_runs import init_distributed, run_trainer
    from muloco.core.comm import close_distributed
    from trainer.training import Trainer

    class FailingTrainer(Trainer):
        def train_step(self):
            if self.step == 7:  # after the outer loop's first background sync (step 5) was launched
                raise RuntimeError("a failure mid-run")
            return super().train_step()

    init_distributed()
    before = {t.ident for t in threading.enumerate()}
    left = {}
    for name, trainer_class in (("finished", Trainer), ("failed", FailingTrainer)):
        try:
            run_trainer([*sys.argv[2:], "--run-dir", f"{sys.argv[1]}/{name}"], trainer_class)
        except RuntimeError:
            pass
        left[name] = sorted(t.name for t in threading.enumerate() if t.ident not in before)
    close_distributed()
    print(json.dumps(left))
""")


def test_every_thread_the_trainer_starts_is_joined_when_it_finishes_or_fails(base, tmp_path):
    """Outer-loop background syncs, the watchdog, TensorBoard's writer: none may outlive the run
    (a thread left running at interpreter exit can abort a rank whose work is done)."""
    ds = json.loads((REPO_ROOT / "ds_configs" / "cpu_tiny_muloco.json").read_text())
    ds["muloco"].update(workers=1, sync_interval=5, streaming={"overlap_steps": 2})
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    flags = ["--ds_config", str(tmp_path / "ds.json"), "--model", "tiny", "--data-path", dataset(base),
             "--vocab-size", "1000", "--train-iters", "12", "--log-interval", "1", "--eval-interval", "0",
             "--hang-timeout-s", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", SHUTDOWN_PROBE, str(tmp_path), *flags], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {"finished": [], "failed": []}
    assert "terminate called" not in result.stderr
