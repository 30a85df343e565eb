"""Draft calls of one sequence go to one draft replica (deployments/routing.py): a stable first choice that
moves only when that replica goes away, and sequences spread over the replicas."""

from types import SimpleNamespace

from app.engine.request import SamplingParams
from app.spec.remote import DraftCall
from deployments.routing import _sequence_id, rank


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
