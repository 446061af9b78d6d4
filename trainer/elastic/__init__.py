"""Elastic MuLoCo: each worker (datacenter) is its own job, and the K jobs meet only in a
fault-tolerant outer group built on torchft (https://github.com/pytorch/torchft).

- `lighthouse`: the quorum server every worker's torchft ManagerServer talks to (`python -m
  trainer.elastic.lighthouse`).
- `quorum`: this rank's torchft Manager and its reconfigurable gloo group, which joins rank (d, p, t)
  of every worker in the current quorum; `QuorumWire` runs the outer exchange on it.
- `membership`: who in a quorum contributes to a sync (left out: joining, non-finite, outlier).
- `outer_loop`: the MuLoCo outer loop on that group: a quorum per sync, K_eff = the members that
  contribute, retries with a fresh quorum when a peer dies or stalls, and state transfer from a live
  peer for a worker that (re)joins.

Only `config` is imported by the config modules; the rest imports torchft.
"""
