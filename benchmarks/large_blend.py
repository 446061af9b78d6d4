"""A blend of 10,000 prefixes under `ulimit -n 1024` (issue 57): the trainer trains on it, where Megatron's own
datasets run out of descriptors on the same blend and limit.

    python benchmarks/large_blend.py [--prefixes 10000] [--limit 1024] [--steps 4]

Writes --prefixes tiny datasets (tools/synthetic_data.py: two documents of 160 tokens each, every token of
dataset i being 1 + i mod 999) and their --data-args-path blend, then lowers this process's soft and hard
`ulimit -n` to --limit (its children inherit them) and runs:
  megatron  Megatron's BlendedMegatronDatasetBuilder(GPTDataset) on the blend, in a child process (the baseline):
            whether it builds, and the error where it stops
  trainer   trainer/pretrain.py on the blend (tiny preset, one rank, torchrun, --steps steps, --split 50,50,0):
            whether it trained, its seconds, and the most descriptors a process of the run held (sampled
            from /proc every 0.2 s)
Last line: JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

from tools.synthetic_data import write_numbered_datasets
from tools.trainer_runs import DS_CONFIGS, PRETRAIN, TINY_VOCAB, launch_ranks, read_metrics

DOCUMENT_TOKENS = 160  # two documents: 160 tokens for each split at 50,50,0, more than the tiny preset's sample


def megatron_baseline(blend: Path, cache: Path) -> dict:
    """Megatron's own builder on the blend in a child process (under this process's limit)."""
    script = textwrap.dedent(f"""
        import json, os
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
        from trainer.data import TokenizerInfo
        items = open({str(blend)!r}).read().split()
        prefixes, weights = items[1::2], [float(w) for w in items[0::2]]
        config = GPTDatasetConfig(blend=(prefixes, weights), split="50,50,0", random_seed=1, sequence_length=128,
                                  tokenizer=TokenizerInfo({TINY_VOCAB}, 0), path_to_cache={str(cache)!r},
                                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        try:
            BlendedMegatronDatasetBuilder(GPTDataset, [64, 16, 0], lambda: True, config).build()
            result = {{"built": True}}
        except Exception as error:
            while error.__cause__ or error.__context__:
                error = error.__cause__ or error.__context__
            result = {{"built": False, "error": repr(error)[:200]}}
        print(json.dumps(result), flush=True)
        os._exit(0)  # not the thousands of "Exception ignored in __del__" of Megatron's half-built datasets
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=3600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"built": False, "error": done.stderr[-500:]}
    return {**result, "seconds": round(time.perf_counter() - start, 1)}


def most_descriptors(marker: str, stop: threading.Event, found: list[int]) -> None:
    """Until `stop`: the most descriptors any process whose command line holds `marker` has open."""
    while not stop.wait(0.2):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker in Path(f"/proc/{pid}/cmdline").read_text():
                    found.append(len(os.listdir(f"/proc/{pid}/fd")))
            except OSError:  # gone meanwhile
                continue


def train(blend: Path, run_dir: Path, steps: int) -> dict:
    stop, found = threading.Event(), [0]
    sampler = threading.Thread(target=most_descriptors, args=(str(run_dir), stop, found), daemon=True)
    sampler.start()
    start = time.perf_counter()
    result = launch_ranks(PRETRAIN, 1, [
        "--ds_config", str(DS_CONFIGS["adamw"]), "--model", "tiny", "--data-args-path", str(blend),
        "--vocab-size", str(TINY_VOCAB), "--split", "50,50,0", "--train-iters", str(steps), "--log-interval", "1",
        "--eval-interval", str(steps), "--eval-iters", "1", "--startup-timeout-s", "3600", "--run-dir",
        str(run_dir)], timeout_s=3600)
    seconds = time.perf_counter() - start
    stop.set()
    sampler.join()
    losses = [record["loss"] for record in read_metrics(run_dir) if "loss" in record] if result.returncode == 0 else []
    notes = [line for line in result.output.splitlines() if line.startswith(("open files:", "data:", "warning:"))]
    return {"trained": result.returncode == 0 and len(losses) == steps, "steps": len(losses),
            "seconds": round(seconds, 1), "most_descriptors": max(found), "lines": notes[:4],
            "tail": "" if result.returncode == 0 else result.output[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=10_000)
    parser.add_argument("--limit", type=int, default=1024, help="ulimit -n (soft and hard) of the runs")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        start = time.perf_counter()
        prefixes = write_numbered_datasets(work / "data", args.prefixes, documents=2, doc_tokens=DOCUMENT_TOKENS,
                                           vocab_size=TINY_VOCAB)
        blend = work / "blend.data_args"
        blend.write_text("".join(f"1 {prefix}\n" for prefix in prefixes))
        print(f"wrote {args.prefixes} prefixes and their blend in {time.perf_counter() - start:.1f} s", flush=True)
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.limit, args.limit))
        baseline = megatron_baseline(blend, work / "megatron_cache")
        print(f"megatron: {baseline}", flush=True)
        ours = train(blend, work / "run", args.steps)
        print(f"trainer: {ours}", flush=True)
    print(json.dumps({"prefixes": args.prefixes, "ulimit_n": args.limit, "megatron": baseline, "trainer": ours}))
    return 0 if ours["trained"] else 1


if __name__ == "__main__":
    sys.exit(main())
