"""One elastic worker, assembled exactly as trainer/pretrain.py assembles it, that dumps every outer
sync it applies (tests/test_elastic.py reads the dumps of all workers while they run).

    deepspeed --num_gpus 1 tests/_elastic_probe.py OUT_DIR [pretrain.py flags, --worker-id k ...]

OUT_DIR/sync<N>.pt (N = the outer step after the sync; written whole, then renamed), a dict:
    time                    wall clock when the sync was applied
    record                  the sync's metrics record (workers_in_sync, quorum, missing, step, ...)
    sha_before, sha_after   muloco.elastic's checksum of the global weights around the sync
and, for the first sync this worker applies with a worker missing from the quorum and nobody left
out, per bucket of flat fp32 buffers in the wire's packing: deltas (this worker's pseudogradient as
sent), averaged, global_before, momentum_before, global_after.
With ELASTIC_PROBE_NAN_AT=WORKER:STEP in the environment, that worker's pseudogradient gets a NaN at
inner step STEP.

    python tests/_elastic_probe.py OUT_DIR [flags]   also works for a worker of one rank (a world of one)
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path


import torch

import muloco.assembly
from tools.trainer_runs import init_distributed, run_trainer
from muloco.core.comm import close_distributed
from muloco.diloco.outer_loop import OuterLoop

ARGS = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher's comes first
OUT = Path(ARGS[0])


POISON = os.environ.get("ELASTIC_PROBE_NAN_AT")  # "WORKER:STEP": that worker's pseudogradient is NaN at STEP


class ProbeLoop(OuterLoop):
    detailed = False

    def sync(self, task, deltas):
        if POISON == f"{self.topology.coords.worker}:{task.step}":
            deltas[0].view(-1)[0] = float("nan")
        self._sent = [d.detach().cpu().clone() for d in deltas]
        return super().sync(task, deltas)

    def _wire_flat(self, fragment: int, tensors: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [spec.packing.flatten([self.tensors[i].to_wire(tensors[i]) for i in spec.indices]).cpu().clone()
                for spec in self.buckets[fragment]]

    def apply(self, result, overlapped):
        fragment = result.fragment
        averaged, record = result.averaged, result.record
        detailed = (averaged is not None and bool(record.get("missing")) and not record.get("left_out")
                    and not ProbeLoop.detailed)
        dump = {"record": dict(record), "sha_before": self.state.checksum(), "time": time.time()}
        if detailed:
            dump.update(deltas=self._sent, averaged=[a.average.cpu().clone() for a in averaged],
                        global_before=self._wire_flat(fragment, self.state.global_weights),
                        momentum_before=self._wire_flat(fragment, self.state.momentum))
        super().apply(result, overlapped)
        dump["sha_after"] = self.state.checksum()
        if detailed:
            dump["global_after"] = self._wire_flat(fragment, self.state.global_weights)
            ProbeLoop.detailed = True
        if self.topology.is_logging_rank:
            OUT.mkdir(parents=True, exist_ok=True)
            path = OUT / f"sync{self.state.outer_step + self.state.skipped}.pt"
            torch.save(dump, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)


if __name__ == "__main__":
    muloco.assembly.OuterLoop = ProbeLoop  # the assembly looks the class up when it builds the loop
    init_distributed()
    run_trainer(ARGS[1:])
    close_distributed()
