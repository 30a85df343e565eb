"""A draft model's sampled drafts, end to end without a model: the draft side's sampler draws each token from
its distribution cut to the top n and returns that distribution (SamplingParams.draft_top_n); the target's
verify_drafts accepts with min(1, p/q) against it. Emitted tokens must follow the target's distribution, and
the acceptance rate must be that of the distribution sent (sum of min(p, q)), not of a one-hot draft.

Tolerances as in test_spec_rejection.py: E[TV] <= 0.5 sqrt(V / N) plus a McDiarmid term for a one in a
million false failure; the seeds are fixed, so the test is deterministic.
"""

import math

import torch

from app.engine.request import Request, SamplingParams
from app.engine.sampling import Sampler, truncated_probs
from app.spec.verify import dense_draft_probs, verify_drafts

V = 16
TOP_N = 6
N = 20_000


def _tol(n: int, vocab: int) -> float:
    return 0.5 * math.sqrt(vocab / n) + math.sqrt(math.log(1e6) / (2 * n))


def _target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    return truncated_probs(logits.unsqueeze(0).clone(), [Request("p", [1], sampling)])[0]


def _draft_tokens(draft_logits: torch.Tensor, sampling: SamplingParams) -> tuple[list[int], list]:
    """N draws by the draft side's sampler: each token and the (ids, probs) it was drawn from."""
    draft_sampling = SamplingParams(**{**sampling.__dict__, "draft_top_n": TOP_N})
    requests = [Request(f"d{i}", [1], draft_sampling) for i in range(N)]
    tokens, logprobs = Sampler().sample_with_logprobs(draft_logits.expand(N, V), requests)
    return tokens, [lp.sampled_from for lp in logprobs]


def test_the_draft_side_draws_from_its_top_n_and_returns_exactly_that_distribution():
    torch.manual_seed(5)
    sampling = SamplingParams(max_tokens=8, temperature=1.0)
    logits = torch.randn(V) * 2
    tokens, sent = _draft_tokens(logits, sampling)
    ids, probs = sent[0]
    assert len(ids) == TOP_N and abs(sum(probs) - 1) < 1e-6
    assert set(ids) == set(_target_probs(logits, sampling).topk(TOP_N).indices.tolist())
    assert all(s == sent[0] for s in sent)  # the same logits: the same distribution on every row
    q = torch.zeros(V, dtype=torch.float64)
    q[ids] = torch.tensor(probs, dtype=torch.float64)
    empirical = torch.bincount(torch.tensor(tokens), minlength=V).double() / N
    assert 0.5 * float((empirical - q).abs().sum()) < _tol(N, V)


def test_sampled_drafts_verified_against_what_they_were_drawn_from_follow_the_target():
    torch.manual_seed(11)
    sampling = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95)
    draft_logits, target_logits = torch.randn(V) * 2, torch.randn(V) * 2
    draft_logits = 0.5 * draft_logits + 0.5 * target_logits  # a draft that half agrees with its target
    tokens, sent = _draft_tokens(draft_logits, sampling)
    requests = [Request(f"t{i}", [1], sampling) for i in range(N)]
    rows = torch.stack([target_logits, torch.zeros(V)]).repeat(N, 1)  # [2N, V]: each draft's position, then its bonus
    emitted, accepted = verify_drafts(rows, requests, [[t] for t in tokens], [None] * N, [[s] for s in sent])

    p = _target_probs(target_logits, sampling).double()
    first = torch.tensor([e[0] for e in emitted])
    empirical = torch.bincount(first, minlength=V).double() / N
    assert 0.5 * float((empirical - p).abs().sum()) < _tol(N, V)

    ids, probs = sent[0]
    q = torch.zeros(V, dtype=torch.float64)
    q[ids] = torch.tensor(probs, dtype=torch.float64)
    rate = sum(accepted) / N
    bound = math.sqrt(math.log(1e6) / (2 * N))
    assert abs(rate - float(torch.minimum(p, q).sum())) < bound  # min(1, p/q): the distribution sent was used
    one_hot_rate = float((q * p).sum())  # what verifying the same drafts as one-hot would accept
    assert float(torch.minimum(p, q).sum()) - one_hot_rate > 4 * bound  # ... and the test can tell the two apart


def test_a_draft_outside_the_distribution_sent_with_it_is_verified_as_one_hot():
    draft_ids = torch.tensor([[3, 5], [7, 0]])
    sent = [[([3, 4], [0.5, 0.5]), ([9], [1.0])], None]  # 5 is not in its distribution; row 1 sent none
    q = dense_draft_probs(draft_ids, [2, 1], sent, vocab_size=8)
    assert q[0, 0, 3] == 0.5 and q[0, 0, 4] == 0.5
    assert q[0, 1].tolist() == [0, 0, 0, 0, 0, 1, 0, 0]
    assert q[1, 0].tolist() == [0, 0, 0, 0, 0, 0, 0, 1] and float(q[1, 1].sum()) == 0  # past its count: padding
