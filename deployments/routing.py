"""Keep a sequence's draft calls on one draft replica, where Serve's request routing allows it.

A draft call carries its sequence's whole context, so any replica can answer it (app/spec/remote.py), but the
replica that answered the sequence's last call still holds its KV (parked for the sequence's next call): routing
the sequence's calls to the same replica saves recomputing them. This router ranks replicas for a draft call by
rendezvous hashing of (sequence id, replica id): every sequence has a stable first choice, which changes
only for sequences whose replica went away when replicas come and go. Every other request (HTTP traffic,
whole completions) is routed as Serve routes by default: power of two choices on queue length. (That router
is a Ray internal, ``ray_compat.py``; the builder imports this module only when a model drafts for another.)
"""

from __future__ import annotations

import hashlib
from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from deployments.ray_compat import power_of_two_router_class

# Serve's default router where this Ray has it where we look (an internal); else the public base class.
_BASE = power_of_two_router_class() or RequestRouter


class SequenceAffinityRouter(_BASE):
    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        sequence_id = _sequence_id(pending_request)
        if sequence_id is None or len(candidate_replicas) < 2:
            if _BASE is RequestRouter:  # the public base has no policy of its own: any of them
                _back_off_when_all_full(pending_request)
                return [list(candidate_replicas)]
            return await super().choose_replicas(candidate_replicas, pending_request)
        _back_off_when_all_full(pending_request)
        return [[replica] for replica in rank(sequence_id, candidate_replicas)]  # the first choice, then the next if full


def _back_off_when_all_full(pending_request: Optional[PendingRequest]) -> None:
    """These candidates are every replica: if all are full, Serve's routing loop must sleep before it asks again.
    It sleeps only where the router says so (Serve's own routers set this once they offer every replica);
    without it, a draft call waiting for a full draft deployment spins, probing every replica's queue each pass."""
    context = getattr(pending_request, "routing_context", None)
    if context is not None:
        context.should_backoff = True


def rank(sequence_id: str, replicas: List[RunningReplica]) -> List[RunningReplica]:
    """Rendezvous hashing: the replicas in the sequence's order of preference (stable as others come and go)."""
    return sorted(replicas, key=lambda r: _weight(sequence_id, r.replica_id.unique_id), reverse=True)


def _sequence_id(pending_request: Optional[PendingRequest]) -> str | None:
    """The sequence of a draft call (its first argument has a ``sequence_id``), else None."""
    if pending_request is None or not pending_request.args:
        return None
    sequence_id = getattr(pending_request.args[0], "sequence_id", None)
    return sequence_id if isinstance(sequence_id, str) else None


def _weight(sequence_id: str, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{sequence_id}/{replica_id}".encode(), digest_size=8).digest(), "big")
