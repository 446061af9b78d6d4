"""The prepared device check and the defects a rehearsal of it on a GPU machine found.

The whole check runs on CPU (`--cpu`: gloo, fp32, the tiny preset, the same stages and steps), so that
it cannot rot between the sessions that have a GPU. The GPU-only defects are shown on CPU with stand-ins:
the meta device for the CUDA device Megatron allocates its buffers on, CPU bf16 autocast for Megatron's
CUDA autocast, a fake accelerator with fewer devices than processes."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from script_modules import load_script
from megatron_world import megatron_world_of_one, tiny_model
from tools.trainer_runs import TINY_VOCAB

REPO = Path(__file__).resolve().parents[1]


gpu_check = load_script("gpu_check")
device_runner, device_runs = load_script("device_runner"), load_script("device_runs")


def _check_env() -> dict:
    return dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.timeout(1200)
@pytest.mark.launch
def test_gpu_check_passes_on_cpu(tmp_path):
    result = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--out", str(tmp_path)],
                            cwd=tmp_path, env=_check_env(), capture_output=True, text=True, timeout=1100)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result.returncode == 0 and report["result"] == "passed", \
        (tmp_path / "gpu_check.md").read_text() + result.stdout[-3000:] + result.stderr[-3000:]
    stages = {s["stage"]: s for s in report["stages"]}
    assert [s["status"] for s in report["stages"]] == ["passed"] * 7 and sorted(stages) == list("abcdefg")
    assert report["seconds"] < report["budget_s"] and all(s["seconds"] <= s["timeout_s"] for s in report["stages"])
    a, b, d, e, f, g = (stages[k]["results"] for k in "abdefg")
    assert a["loss_steps_36_40"] < a["loss_steps_1_5"] - 0.5 and a["tokens_per_s"] > 0
    assert b["identical"] is True  # fp32 on CPU: the resumed steps are bit-identical
    assert d["max_weight_difference_after_sync"] == {"10": 0.0, "20": 0.0}
    assert "verify passed" in stages["c"]["results"]["verify"][-1]
    # e: each optimizer with its shipped config's lr (the tiny CPU configs: Muon 0.02, AdamW 0.003).
    assert (e["muon"]["peak_lr"], e["adamw"]["peak_lr"]) == (
        *(json.loads((REPO / "ds_configs" / f"cpu_tiny_{o}.json").read_text())["optimizer"]["params"]["lr"]
          for o in ("muon", "adamw")),)
    assert e["muon"]["tokens_per_s"] > 0 and e["adamw"]["tokens_per_s"] > 0 and "muon_step_overhead_vs_adamw" in e
    # Muon ran with the Newton-Schulz form the stage timed fastest for a layer.
    forms = e["newton_schulz_forms"]
    assert e["muon"]["ns_form"] == forms["fastest_for_a_layer"] == min(forms["layer_s"], key=forms["layer_s"].get)
    assert all(forms[f"tiny {c}"]["relative_difference"] < 1e-4 for c in ("square 128x128", "tall 352x128", "wide 128x352"))
    assert set(f["gloo_collectives_on_cpu"].values()) == {"ok"} and f["outer_syncs"] == 2
    assert f["max_weight_difference_after_sync"] == {"2": 0.0, "4": 0.0}
    assert g["outer_backend"] == "gloo" and g["outer_syncs"] >= 2
    assert (tmp_path / "gpu_check.md").read_text().startswith("# Device check (cpu)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md"]  # what $OUT carries back
    assert not (REPO / "results" / "gpu_check.json").exists() or \
        json.loads((REPO / "results" / "gpu_check.json").read_text())["mode"] == "gpu", "the GPU report is kept"


# -- the time budget and the report after every stage ------------------------------------------------

def test_each_stage_gets_the_smaller_of_its_cap_and_what_is_left():
    now = [1000.0]
    budget = device_runner.Budget(total_s=360.0, started=1000.0, clock=lambda: now[0])
    assert budget.stage_timeout(70) == 70
    now[0] = 1000.0 + 300  # 60 s left, 5 of them kept for the last report
    assert budget.left() == 60 and budget.stage_timeout(70) == 60 - device_runner.REPORT_RESERVE_S
    now[0] = 1000.0 + 400
    assert budget.stage_timeout(70) == 0.0
    # The caps may add up past the budget (a stage that ends early leaves its time to the next): the
    # budget, 6 minutes on the GPU, bounds the whole check.
    assert min(s.cap_s["gpu"] for s in gpu_check.STAGES) >= device_runner.MIN_STAGE_S and gpu_check.GPU.budget_s == 360


@pytest.mark.launch
def test_a_spent_budget_starts_no_stage_and_reports_each(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--cpu", "--budget-s", "1",
                             "--out", str(tmp_path)], cwd=tmp_path, env=_check_env(), capture_output=True, text=True,
                            timeout=300)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result.returncode == 1, result.stdout + result.stderr
    assert [s["stage"] for s in report["stages"]] == list("abcdefg")
    # b and c need a's checkpoint; every other stage is stopped by the budget alone.
    assert [s["status"].split(":")[0] for s in report["stages"]] == ["not run"] * 7
    assert "time budget" in report["stages"][0]["status"] and "needs stage a" in report["stages"][1]["status"]
    assert report["result"].startswith("FAILED or not run") and "| g |" in (tmp_path / "gpu_check.md").read_text()


def _start_check_and_wait_for_its_trainer(tmp_path: Path) -> tuple[subprocess.Popen, list[psutil.Process]]:
    check = subprocess.Popen(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu", "--stages", "a", "--out",
                              str(tmp_path)], cwd=tmp_path, env=dict(_check_env(), TMPDIR=str(tmp_path)),
                             stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        children = psutil.Process(check.pid).children(recursive=True)
        if any("pretrain.py" in _command_line(c) for c in children):
            return check, children
        time.sleep(0.2)
    check.kill()
    raise AssertionError("the check started no trainer within 120 s")


def _command_line(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # gone, or a zombie, since it was listed
        return ""


def _gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until_gone(processes: list[psutil.Process], timeout_s: float = 30) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(map(_gone, processes)):
        time.sleep(0.2)
    return [p for p in processes if not _gone(p)]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.launch
def test_a_killed_check_leaves_no_process_behind(tmp_path, how):
    """SIGTERM (the device tool's timeout): the check kills its stage's processes and writes the
    report; SIGKILL: its children die with it (they are in its session, bound to its life), and the
    report written when the stage started remains."""
    check, children = _start_check_and_wait_for_its_trainer(tmp_path)
    sessions = set()
    for child in children:
        with contextlib.suppress(ProcessLookupError):  # one that already exited has no session to leak
            sessions.add(os.getsid(child.pid))
    assert sessions <= {os.getsid(check.pid)}, "a child in a session of its own would outlive the device command"
    check.send_signal(how)
    check.wait(timeout=60)
    survivors = _wait_until_gone(children)
    for p in survivors:
        p.kill()
    assert not survivors, [_command_line(p) for p in survivors]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    if how == signal.SIGTERM:
        assert check.returncode == 128 + signal.SIGTERM and report["result"].startswith("killed")
        assert report["stages"][0]["status"].startswith("killed")
    else:  # no last word: the report written as the stage started is what comes back
        assert report["result"] == "running" and report["stages"][0]["status"] == "running"


def test_memory_above_the_plan_by_more_than_15_percent_fails_the_stage():
    assert device_runs.memory_against_plan(11.4, 10.0)["memory_vs_plan"] == 1.14
    with pytest.raises(device_runner.StageFailed, match="underestimates"):
        device_runs.memory_against_plan(11.6, 10.0)
    assert "n/a" in device_runs.memory_against_plan(None, 10.0)["memory_vs_plan"]


# -- stage c: the export's verify on a CUDA machine --------------------------------------------------

def test_verify_runs_the_t1_model_where_megatron_puts_its_buffers(monkeypatch):
    """Without the CPU shims (an accelerator is present) Megatron's RoPE moves its frequencies to
    torch.cuda.current_device() at the first forward; the meta device stands in for that device."""
    from tools.convert_checkpoint.verify import trainer_logits, trainer_model
    from trainer.model.builder import canonical_names, padded_vocab_size
    from trainer.model.presets import PRESETS

    with megatron_world_of_one():
        model = tiny_model()
        names = canonical_names(model)
        weights = [(names[n], p.detach().clone()) for n, p in model.named_parameters()]
        monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
        rebuilt = trainer_model(PRESETS["tiny"], padded_vocab_size(TINY_VOCAB, 1), weights)
        logits = trainer_logits(rebuilt, torch.randint(0, TINY_VOCAB, (1, 8)), TINY_VOCAB)
    assert logits.device.type == "meta" and logits.shape == (1, 8, TINY_VOCAB)


# -- stage c: the probe a checkpoint records is fp32 ----------------------------------------------------

def test_the_checkpoint_probe_is_fp32_under_bf16_training(monkeypatch):
    """Megatron's schedules run the forward under autocast("cuda", bf16) when the model trains in bf16;
    CPU autocast stands in for it. The probe must equal the fp32 forward (verify's reference)."""
    from megatron.core.pipeline_parallel import schedules

    from trainer.checkpoint.checkpointer import probe_logits, probe_tokens
    from trainer.model.builder import build_model, initialize_weights, padded_vocab_size
    from trainer.model.presets import PRESETS

    from megatron_patches import apply_cpu_shims_if_needed

    apply_cpu_shims_if_needed()  # Megatron's schedules then see a stand-in `torch` of their own
    assert schedules.torch is not torch
    cpu_autocast = torch.autocast
    monkeypatch.setattr(schedules.torch, "autocast", lambda device, dtype: cpu_autocast("cpu", dtype=dtype))
    with megatron_world_of_one():
        model = build_model(PRESETS["tiny"], padded_vocab_size(TINY_VOCAB, 1), bf16_autocast=True)
        initialize_weights(model, PRESETS["tiny"], 1234)
        tokens = probe_tokens(TINY_VOCAB, 32)
        with torch.no_grad():
            fp32 = model(tokens, torch.arange(32).unsqueeze(0), None).float()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                bf16 = model(tokens, torch.arange(32).unsqueeze(0), None).float()
        probe = probe_logits(model, tokens)
        assert model.config.enable_autocast and model.config.pipeline_dtype == torch.bfloat16  # restored
    assert (bf16 - fp32).abs().max() > 1e-3  # the stand-in does change the numbers
    assert probe.dtype == torch.float32
    torch.testing.assert_close(probe, fp32, rtol=0, atol=1e-6)


# -- stage d: processes sharing one GPU --------------------------------------------------------------

class _OneCudaDevice:
    """DeepSpeed's accelerator interface as a one-GPU CUDA machine shows it."""

    def __init__(self):
        self.current = None

    def device_name(self, index=None):
        return "cuda" if index is None else f"cuda:{index}"

    def device_count(self):
        return 1

    def set_device(self, index):
        if index >= 1:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.current = index

    def device(self, index=None):
        return torch.device("cuda", index or 0)


def test_a_second_process_on_a_one_gpu_machine_shows_deepspeed_the_gpu_it_uses(monkeypatch):
    import deepspeed.accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine

    from muloco.core import comm

    fake = _OneCudaDevice()
    monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda: fake)
    monkeypatch.setattr("deepspeed.runtime.engine.get_accelerator", lambda: fake)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(comm, "_compute_device", None)
    assert comm.init_compute_device(1) == torch.device("cuda", 0) and fake.current == 0
    # DeepSpeed's engine takes its device from LOCAL_RANK (set_device(local_rank)).
    engine = object.__new__(DeepSpeedEngine)
    DeepSpeedEngine._configure_with_arguments(engine, None, None)
    monkeypatch.setattr("deepspeed.runtime.engine.dist", SimpleNamespace(get_world_size=lambda: 2, get_rank=lambda: 1))
    DeepSpeedEngine._set_distributed_vars(engine, None)
    assert engine.local_rank == 0 and engine.device == torch.device("cuda", 0)
    # The default group: NCCL bound to that device; gloo (how processes share a GPU) bound to none.
    assert comm.default_group_options("nccl", 2) == {"device_id": torch.device("cuda", 0)}
    assert comm.default_group_options("gloo", 2) == {} and comm.default_group_options("nccl", 1) == {}
