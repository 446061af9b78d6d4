"""Fingerprints of the outer loop's behaviour, for checking that a refactor changed nothing: run it before
and after and compare the printed lines (they must be identical).

    python scripts/behaviour_fingerprint.py [--keep DIR]

Two runs, on CPU:
  trainer  K=2 workers of one rank each, 4-bit statistical + error feedback, F=2 streaming fragments,
           overlap tau=1, H=4, 8 steps, checkpoint at the end: sha256 of every tensor of every rank file
           (the model, the inner optimizer, the outer state), one line per rank file.
  hook     the DeepSpeed hook probe (tests/_deepspeed_hook_probe.py: ZeRO 0-3, resume, guards): sha256 of
           each case's final weights and of each worker's global weights, one line per case and rank.
Tensors are hashed (not the files), so a file's metadata order or timestamps do not count."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from muloco.core.rank_file import read_rank_file, to_plain
from tools.trainer_runs import EXTENSIONS_ENV, REPO_ROOT, launch_port, launch_ranks, launcher_command

TRAIN_ITERS = 8


def tensors_sha256(tree) -> str:
    """One digest over every tensor of a nested structure, in key order (names included)."""
    digest = hashlib.sha256()

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for key in sorted(node, key=str):
                walk(f"{prefix}/{key}", node[key])
        elif isinstance(node, (list, tuple)):
            for i, item in enumerate(node):
                walk(f"{prefix}/{i}", item)
        elif isinstance(node, torch.Tensor):
            digest.update(prefix.encode())
            digest.update(str(node.dtype).encode())
            digest.update(node.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        else:
            digest.update(f"{prefix}={node!r}".encode())

    walk("", tree)
    return digest.hexdigest()[:16]


def trainer_run(work: Path) -> list[str]:
    from tools.synthetic_data import write_markov_dataset

    data = str(work / "markov")
    write_markov_dataset(data, vocab_size=1000)
    config = json.loads((REPO_ROOT / "ds_configs" / "cpu_tiny_muloco.json").read_text())
    config["muloco"].update(sync_interval=4, streaming={"fragments": 2, "overlap_steps": 1})
    ds_config = work / "ds_config.json"
    ds_config.write_text(json.dumps(config))
    key = work / "job.key"  # a fixed secret: the rank files hold its digest
    key.write_text(hashlib.sha256(b"behaviour fingerprint").hexdigest() + "\n")
    key.chmod(0o600)
    save = work / "checkpoints"
    command = [*launcher_command("torchrun", 2, launch_port()), "trainer/pretrain.py", "--ds_config", str(ds_config),
               "--model", "tiny", "--data-path", data, "--vocab-size", "1000", "--train-iters", str(TRAIN_ITERS),
               "--log-interval", "1", "--eval-interval", "0", "--run-dir", str(work / "run"), "--save", str(save)]
    env = {**os.environ, **EXTENSIONS_ENV, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MULOCO_AUTH_KEY_FILE": str(key)}
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"the trainer run failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return [f"trainer {path.relative_to(save)} {tensors_sha256(to_plain(read_rank_file(path)))}"
            for path in sorted(save.rglob("*.safetensors"))]


def hook_probe(work: Path) -> list[str]:
    out = work / "hook"
    launch_ranks(REPO_ROOT / "tests" / "_deepspeed_hook_probe.py", 4, [str(out)], timeout_s=900).check("the hook probe")
    return probe_hashes(out)


def probe_hashes(out: Path) -> list[str]:
    """A line per case and rank that trained: its losses, final weights and worker's global weights (the cases
    that only check a refusal write none of them)."""
    lines = []
    for path in sorted(out.glob("*.rank*.pt")):
        result = torch.load(path, weights_only=True)
        parts = [f"{key}={tensors_sha256(result[key])}" for key in ("losses", "weights", "global_weights")
                 if key in result]
        if parts:
            lines.append(f"hook {path.name} {' '.join(parts)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary one, removed)")
    parser.add_argument("--only", choices=("trainer", "hook"), help="one of the two runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        work = Path(args.keep or temporary)
        work.mkdir(parents=True, exist_ok=True)
        for name, run in (("trainer", trainer_run), ("hook", hook_probe)):
            if args.only in (None, name):
                (work / name).mkdir(exist_ok=True)
                for line in run(work / name):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
