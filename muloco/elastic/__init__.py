"""Elastic MuLoCo: each worker (datacenter) is its own job, and the K jobs meet only in a
fault-tolerant outer group built on torchft (https://github.com/pytorch/torchft).

- `lighthouse`: the quorum server every worker's torchft ManagerServer talks to (`python -m
  muloco.elastic.lighthouse`), behind `tunnel`'s authenticated gateway, in a network of its own
  (`private_network`) that only the gateway reaches.
- `authentic_quorum`: which members of torchft's quorum count (those whose replica id the job secret
  signed).
- `quorum`: this rank's torchft Manager and its reconfigurable group, which joins rank (d, p, t) of
  every worker in the current quorum; `QuorumWire` runs the outer exchange on it.
- `membership`: the outer loop's membership on that group (muloco/diloco/membership.py): a quorum
  per sync, who in it contributes, retries with a fresh quorum when a peer dies or stalls, and the
  state a member behind its peers receives first.

Its settings block is muloco/diloco/elastic_config.py (part of the muloco block); everything here imports
torchft.
"""
