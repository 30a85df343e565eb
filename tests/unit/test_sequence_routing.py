"""Draft calls of one sequence go to one draft replica (deployments/routing.py): a stable first choice that
moves only when that replica goes away, and sequences spread over the replicas."""

from types import SimpleNamespace

from ray.serve._private.request_router.common import PendingRequest, RequestRoutingContext

from app.engine.request import SamplingParams
from app.spec.remote import DraftCall
from deployments.routing import SequenceAffinityRouter, _sequence_id, rank


def _replicas(*ids):
    return [SimpleNamespace(replica_id=SimpleNamespace(unique_id=i)) for i in ids]


def test_a_sequence_keeps_its_replica_and_moves_only_when_that_replica_goes():
    replicas = _replicas("a", "b", "c", "d")
    first = {seq: rank(seq, replicas)[0].replica_id.unique_id for seq in (f"seq-{i}" for i in range(200))}
    assert len(set(first.values())) == 4  # spread over every replica
    assert all(rank(seq, list(reversed(replicas)))[0].replica_id.unique_id == r for seq, r in first.items())
    fewer = [r for r in replicas if r.replica_id.unique_id != "b"]
    for seq, chosen in first.items():
        now = rank(seq, fewer)[0].replica_id.unique_id
        assert now == chosen or chosen == "b"  # only the sequences of the replica that left move


def test_only_draft_calls_carry_a_sequence():
    call = DraftCall(1, 0, "seq-1", [1], [], 4, SamplingParams())
    assert _sequence_id(SimpleNamespace(args=[call], kwargs={})) == "seq-1"
    assert _sequence_id(SimpleNamespace(args=[{"model": "m"}], kwargs={})) is None
    assert _sequence_id(SimpleNamespace(args=[], kwargs={})) is None and _sequence_id(None) is None


async def test_a_draft_call_backs_off_when_every_replica_is_full():
    """Serve's routing loop sleeps between passes only where the router sets should_backoff: a draft call waiting
    on a full draft deployment must not spin, probing every replica's queue each pass."""
    router = object.__new__(SequenceAffinityRouter)  # choose_replicas needs none of the router's state for a draft call
    call = DraftCall(1, 0, "seq-1", [1], [], 4, SamplingParams())
    pending = PendingRequest(args=[call], kwargs={}, metadata=SimpleNamespace(multiplexed_model_id=""),
                             routing_context=RequestRoutingContext())
    assert not pending.routing_context.should_backoff
    ranked = await router.choose_replicas(_replicas("a", "b"), pending)
    assert sorted(r[0].replica_id.unique_id for r in ranked) == ["a", "b"]
    assert pending.routing_context.should_backoff
