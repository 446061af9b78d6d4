"""The outer loop's own state as a snapshot (snapshot.py) and back: who this rank is, what its
snapshots look like, what is taken (a checkpoint's error feedback and syncs in flight with what this rank
sent; a catch-up's landed results), and what loading one does to the loop (outer_loop.OuterLoop)."""
from __future__ import annotations

import torch

from muloco.diloco.averaging import Averaged
from muloco.diloco.plan import plan_signature
from muloco.diloco.snapshot import (CATCH_UP, CHECKPOINT, Form, Identity, InFlight, Joins, Snapshot, SnapshotError,
                                    identity_problems)
from muloco.diloco.sync import PendingSync, SyncResult, SyncTask, done_future


def identity(loop) -> Identity:
    """Who this rank is, as its snapshots say."""
    sizes, c = loop.topology.sizes, loop.topology.coords
    return Identity(loop.config.auth.job_id if loop.config.talks and loop.config.auth != "none" else "",
                    loop.key.snapshot_tag() if loop.key is not None else "", c.worker, loop.topology.rank,
                    (loop.config.workers, sizes.data, sizes.pipeline, sizes.tensor),
                    plan_signature(loop.tensors).hex())

def form(loop) -> Form:
    """What this rank's snapshots look like (checked on load: they are loaded with copy_)."""
    state = loop.state
    with_feedback = [i for specs in loop.buckets for spec in specs if spec.error_feedback for i in spec.indices]
    schedule = loop.host.schedule_state() if loop.host is not None else None
    return Form({loop.tensors[i].name: (w.dtype, tuple(w.shape)) for i, w in state.global_weights.items()},
                {loop.tensors[i].name: tuple(loop.tensors[i].wire_shape) for i in with_feedback},
                [[spec.numel for spec in specs] for specs in loop.buckets],
                None if schedule is None else frozenset(schedule))

def take(loop, kind: str = CHECKPOINT, joins: SyncTask | None = None) -> Snapshot:
    """This rank's outer state (tensors shared, not copied: save or send it before the next sync
    applies). A checkpoint holds the error feedback and every sync in flight with what this rank sent
    (replayed on load); a catch-up for a member behind (`joins`: the sync it takes part in) the landed
    syncs' results instead; it is taken by the thread running that sync, consistent with the main
    thread's applies."""
    state = loop.state
    with state.lock:
        tensors = state.tensors_by_name()
        if kind == CHECKPOINT:
            in_flight = [InFlight(e.task.fragment, e.task.step, e.apply_at, e.task.outer_step, e.deltas)
                         for e in loop.pending]
            feedback = error_feedback_state(loop)
        else:  # a peer's copy: the tensors are cloned, the main thread applies on
            tensors = {key: {n: t.clone() for n, t in part.items()} for key, part in tensors.items()}
            in_flight = [InFlight(e.task.fragment, e.task.step, e.apply_at, e.task.outer_step, [],
                                  None if e.future.result().averaged is None
                                  else [a.average for a in e.future.result().averaged])
                         for e in loop.pending if e.future.done()]
            feedback = {}
        overlap_needed = ({f: float(t.result().get("overlap_needed") or 0.0) for f, t in sorted(loop.timings.items())}
                          if loop.auto_overlap else {})
        step = loop.host.inner_step() if loop.host is not None else (joins.step if joins else 0)
        return Snapshot(kind, identity(loop), step, state.outer_step, state.skipped, tensors["global_weights"],
                        tensors["momentum"], feedback, in_flight, overlap_needed,
                        loop.pacer.deadline if loop.pacer is not None else None,
                        None if joins is None else Joins(joins.fragment, joins.step, joins.outer_step,
                                                         joins.scheduler or (loop.host.schedule_state()
                                                                             if loop.host else None)))

def read(loop, tree, kind: str, source: str) -> Snapshot:
    """The snapshot in `tree`, checked against this rank's form and identity (SnapshotError naming
    `source` otherwise): a checkpoint must be this rank's own, a catch-up a peer's of this job and plan."""
    snapshot = Snapshot.from_tree(tree, form(loop), source)
    problems = [] if snapshot.kind == kind else [f"it is a {snapshot.kind} snapshot, not a {kind} one"]
    problems += identity_problems(snapshot.identity, identity(loop), kind)
    if kind == CHECKPOINT and loop.host is not None and snapshot.step != loop.host.inner_step():
        problems.append(f"it was taken at inner step {snapshot.step}, but the run is at step "
                        f"{loop.host.inner_step()}: the outer state and the model's checkpoint are of different "
                        f"steps")
    if problems:
        raise SnapshotError(f"{source} is refused: " + "; ".join(problems))
    return snapshot

@torch.no_grad()
def restore(loop, snapshot: Snapshot) -> SyncTask | None:
    """Take a checked snapshot (`read_snapshot`). A checkpoint: its error feedback and in-flight syncs
    (replayed, unless the membership catches a restarted worker up from its peers instead); returns
    None. A peer's catch-up: its error feedback restarts from zero (it held what this member's own
    payloads did not carry), the peer's landed syncs replace this member's (its own sync in flight,
    of a member that fell behind mid-run, stays); returns the sync to take part in, whose result
    moves the local weights and the run's position to the peers' (`_go_on_from`)."""
    with loop.state.lock:
        loop.state.load_tensors(snapshot)
        if snapshot.kind == CATCH_UP:
            keep_error_feedback(loop, {})
            loop.pending = [PendingSync(e.apply_at, SyncTask(e.fragment, e.launched_at, e.outer_step, None), [],
                                     done_future(SyncResult(e.fragment, None if e.averages is None else
                                                      [Averaged(a, torch.zeros_like(a)) for a in e.averages], {})))
                            for e in snapshot.in_flight] + [e for e in loop.pending if not e.future.done()]
            loop.joining = True
            j = snapshot.joins
            return SyncTask(j.fragment, j.step, j.outer_step, j.scheduler)
    keep_error_feedback(loop, snapshot.error_feedback)
    if loop.pacer is not None and snapshot.pace_deadline_s is not None:
        loop.pacer.deadline = snapshot.pace_deadline_s
    if loop.auto_overlap:
        loop.timings = {f: done_future({"overlap_needed": needed or None}) for f, needed in snapshot.overlap_needed.items()}
    tasks = [SyncTask(e.fragment, e.launched_at, e.outer_step, None) for e in snapshot.in_flight]
    if tasks and not loop.membership.replays_pending:
        if loop.topology.is_logging_rank:
            print(f"outer loop: {len(tasks)} syncs in flight in the checkpoint are dropped: this worker catches up "
                  f"from its peers", flush=True)
        loop.pending = []
        return None
    loop.pending = [PendingSync(e.apply_at, task, e.deltas, loop.background.submit(loop.sync, task, e.deltas))
                    for e, task in zip(snapshot.in_flight, tasks)]
    return None

def error_feedback_state(loop) -> dict[str, torch.Tensor]:
    """Error-feedback residuals by tensor name, in wire shape (none before the first sync)."""
    state = {}
    for specs in loop.buckets:
        for spec in specs:
            if spec.error_feedback and spec.error_feedback.error is not None:
                residuals = spec.packing.unflatten(spec.error_feedback.error)
                state.update({loop.tensors[i].name: r for i, r in zip(spec.indices, residuals)})
    return state

def keep_error_feedback(loop, residuals: dict[str, torch.Tensor]) -> None:
    """Every bucket's error feedback from `residuals` by name (empty: restart from zero)."""
    for specs in loop.buckets:
        for spec in specs:
            if not spec.error_feedback:
                continue
            if not residuals:
                spec.error_feedback.error = None
                continue
            device = loop.tensors[spec.indices[0]].tensor.device
            spec.error_feedback.keep(spec.packing.flatten([residuals[loop.tensors[i].name].to(device)
                                                           for i in spec.indices]))
