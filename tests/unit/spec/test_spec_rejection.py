"""The rejection sampler: lossless in distribution (statistically, over many rows at once), exact when greedy.

Tolerance for an empirical distribution from N independent draws over V tokens: E[TV] <= 0.5 sqrt(V / N)
(Cauchy-Schwarz over E|p_hat_i - p_i| <= sqrt(p_i / N)), and TV moves by at most 1/N per draw, so by
McDiarmid P(TV > E[TV] + t) <= exp(-2 N t^2); t = sqrt(ln(1e6) / (2N)) makes a false failure a one in a
million event (and the seeds are fixed, so it is deterministic). Each test also checks that the bound is
tight enough to catch the plausible bugs (emitting from q, recovering from p instead of the residual,
taking the bonus from the wrong position).
"""

import math

import pytest
import torch

from app.engine.sampling import draw_rows
from app.spec.rejection import PLACEHOLDER_TOKEN_ID, padded_from_packed, rejection_sample


def tol(n: int, vocab: int) -> float:
    return 0.5 * math.sqrt(vocab / n) + math.sqrt(math.log(1e6) / (2 * n))


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def empirical(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def random_dists(rows: int, vocab: int, gen: torch.Generator, scale: float = 1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=gen) * scale, dim=-1)


def wrong_recovery_first_token(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The first token's law if the recovered token came from p instead of norm(max(0, p - q))."""
    accepted = torch.minimum(p, q)
    return accepted + (1 - accepted.sum()) * p


@pytest.mark.parametrize("with_q", [True, False])
def test_every_emitted_token_follows_the_target(with_q):
    gen = torch.Generator().manual_seed(1234)
    torch.manual_seed(99)
    B, K, V = 60_000, 3, 16
    p = random_dists(K + 1, V, gen).double()  # [K+1, V], the same in every row
    if with_q:  # drafts verified against the q they came from, near enough to p that many reach the bonus
        q = 0.5 * p[:K] + 0.5 * random_dists(K, V, gen).double()  # [K, V]
    else:  # a drafter with no probabilities (n-gram), verified as a one-hot q: lossless whatever it
        q = p[:K] ** 3 / (p[:K] ** 3).sum(-1, keepdim=True)  # drafts; here tokens favoured more than p does
    draft = torch.stack([torch.multinomial(q[j], B, replacement=True, generator=gen) for j in range(K)], 1)
    draft_probs = q.float().expand(B, K, V) if with_q else None
    out = rejection_sample(draft, torch.full((B,), K), draft_probs, p.float().expand(B, K + 1, V))

    assert out.token_ids.shape == (B, K + 1)
    assert bool(((out.num_accepted >= 0) & (out.num_accepted <= K)).all())
    for j in range(K + 1):  # token j, among rows whose first j drafts were accepted, follows p_j
        reached = out.num_accepted >= j
        n = int(reached.sum())
        assert n > 1_000
        seen = empirical(out.token_ids[reached, j], V)
        assert tv(seen, p[j]) < tol(n, V), (j, tv(seen, p[j]), tol(n, V))
    # the bound would have caught emitting the drafted tokens, or recovering from p instead of the residual
    assert tv(q[0], p[0]) > 3 * tol(B, V)
    if with_q:
        assert tv(wrong_recovery_first_token(p[0], q[0]), p[0]) > 3 * tol(B, V)
    # accepted drafts are the drafted tokens
    keep = torch.arange(K).unsqueeze(0) < out.num_accepted.unsqueeze(1)
    assert torch.equal(out.token_ids[:, :K][keep], draft[keep])


def test_different_draft_lengths_in_one_batch_take_the_bonus_at_their_own_length():
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    B, K, V = 48_000, 3, 12
    p = random_dists(K + 1, V, gen).double()
    q = random_dists(K, V, gen).double()
    n = torch.arange(B) % (K + 1)  # lengths 0, 1, 2, 3 interleaved
    draft = torch.stack([torch.multinomial(q[j], B, replacement=True, generator=gen) for j in range(K)], 1)
    draft[torch.arange(K).unsqueeze(0) >= n.unsqueeze(1)] = PLACEHOLDER_TOKEN_ID  # padding is not looked at
    out = rejection_sample(draft, n, q.float().expand(B, K, V), p.float().expand(B, K + 1, V))

    assert bool((out.num_accepted <= n).all())
    assert torch.equal(out.num_emitted, (out.token_ids != PLACEHOLDER_TOKEN_ID).sum(1))
    for length in range(K + 1):
        rows = n == length
        # all accepted: the bonus (position `length`) follows p[length], not p[K]
        full = rows & (out.num_accepted == length)
        bonus = out.token_ids[full, length]
        assert tv(empirical(bonus, V), p[length]) < tol(int(full.sum()), V)
        if length < K:
            assert tv(p[length], p[K]) > 3 * tol(int(full.sum()), V)
        first = empirical(out.token_ids[rows, 0], V)
        assert tv(first, p[0]) < tol(int(rows.sum()), V)


@pytest.mark.parametrize("v_q,v_p", [(16, 12), (12, 16)])
def test_padded_vocabularies_stay_lossless(v_q, v_p):
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    B, K = 40_000, 2
    p = random_dists(K + 1, v_p, gen).double()  # when v_p > v_q the target has real mass on ids q lacks
    q = random_dists(K, v_q, gen).double()  # when v_q > v_p the draft puts mass on ids the target lacks
    draft = torch.stack([torch.multinomial(q[j], B, replacement=True, generator=gen) for j in range(K)], 1)
    out = rejection_sample(draft, torch.full((B,), K), q.float().expand(B, K, v_q), p.float().expand(B, K + 1, v_p))

    assert int(out.token_ids.max()) < v_p
    assert not bool((draft[:, 0] >= v_p)[out.num_accepted > 0].any())  # an id the target lacks is never accepted
    for j in range(K + 1):
        reached = out.num_accepted >= j
        assert tv(empirical(out.token_ids[reached, j], v_p), p[j]) < tol(int(reached.sum()), v_p)
    if v_p > v_q:  # truncating p to the shared vocabulary would lose this mass
        assert float(p[0, v_q:].sum()) > 3 * tol(B, v_p)


def greedy_target(argmaxes: list[int], vocab: int = 6) -> torch.Tensor:
    """[1, len, vocab] probabilities, soft, with the given argmax at each position."""
    p = torch.full((len(argmaxes), vocab), 0.5 / (vocab - 1))
    p[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.5
    return p.unsqueeze(0)


@pytest.mark.parametrize("draft,count,expected", [
    ([2, 4, 1], 3, [2, 4, 1, 3]),  # all accepted, then the bonus argmax at position 3
    ([0, 4, 1], 3, [2]),  # first rejected: argmax at position 0
    ([2, 0, 1], 3, [2, 4]),  # middle rejected: the accepted 2, then argmax at position 1
    ([2, 4, 5], 2, [2, 4, 1]),  # two drafted: bonus at position 2; the padding (5) is not looked at
    ([5, 5, 5], 0, [2]),  # nothing drafted: plain greedy decoding
])
def test_greedy_accepts_while_the_draft_is_the_argmax(draft, count, expected):
    p = greedy_target([2, 4, 1, 3])
    q = torch.softmax(torch.randn(1, 3, 6), -1)  # greedy ignores q entirely
    for draft_probs in (None, q):
        out = rejection_sample(torch.tensor([draft]), [count], draft_probs, p, is_greedy=[True],
                               generators=[torch.Generator().manual_seed(0)])
        assert out.tolist() == [expected]
        assert out.num_accepted.tolist() == [len(expected) - 1]
        assert out.token_ids[0, len(expected):].eq(PLACEHOLDER_TOKEN_ID).all()


def test_sampled_rows_with_certain_outcomes():
    V = 5
    one_hot = torch.eye(V)
    # row 0: p and q agree on certainty -> always accepted, bonus certain; row 1: p gives the draft 0 -> rejected,
    # recovered from max(0, p - q) = p; row 2: no q, p certain of the drafted token then of token 4.
    p = torch.stack([
        torch.stack([one_hot[1], one_hot[3], one_hot[0]]),
        torch.stack([one_hot[2], one_hot[0], one_hot[0]]),
        torch.stack([one_hot[1], one_hot[1], one_hot[4]]),
    ])  # [3, 3, V]
    q = torch.stack([torch.stack([one_hot[1], one_hot[3]]), torch.stack([one_hot[1], one_hot[0]]),
                     torch.full((2, V), 1.0 / V)])  # [3, 2, V]
    draft = torch.tensor([[1, 3], [1, 0], [1, 1]])
    for _ in range(20):
        out = rejection_sample(draft, [2, 2, 2], q, p)
        assert out.tolist() == [[1, 3, 0], [2], [1, 1, 4]]
        out = rejection_sample(draft, [2, 2, 2], None, p)
        assert out.tolist() == [[1, 3, 0], [2], [1, 1, 4]]


def test_a_token_the_target_rules_out_is_never_accepted_whatever_q_came_with_it():
    """q <= 0 at the drafted token (no distribution the draft drew from says so): u * q < p held at p = 0 for a
    negative q, and the target's banned token went out."""
    V = 4
    p = torch.tensor([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]])  # token 0 ruled out at the first position
    for q_value in (-1.0, 0.0):
        q = torch.zeros(1, 1, V)
        q[0, 0, 0] = q_value
        for _ in range(50):
            out = rejection_sample(torch.tensor([[0]]), [1], q, p)
            assert int(out.num_accepted[0]) == 0 and int(out.token_ids[0, 0]) in (1, 2)


def test_seeded_rows_repeat_alone_or_in_any_batch_and_padding():
    gen = torch.Generator().manual_seed(3)
    V = 20
    p_row = random_dists(4, V, gen, scale=0.5)  # flat: acceptance and the final draw both matter
    q_row = random_dists(3, V, gen, scale=0.5)
    d_row = torch.tensor([3, 7, 11])

    def alone(seed):
        out = rejection_sample(d_row[None], [3], q_row[None], p_row[None],
                               generators=[torch.Generator().manual_seed(seed)])
        return out.tolist()[0]

    # in a batch: padded to K = 5, at row 2 of 4, beside unseeded, greedy and other seeded rows
    B, K = 4, 5
    draft = torch.randint(0, V, (B, K), generator=gen)
    draft[2, :3] = d_row
    p = random_dists(B * (K + 1), V, gen).reshape(B, K + 1, V)
    q = random_dists(B * K, V, gen).reshape(B, K, V)
    p[2, :4], q[2, :3] = p_row, q_row
    seeds = list(range(40))
    batch = [rejection_sample(draft, [5, 2, 3, 4], q, p, is_greedy=[False, True, False, False],
                              generators=[None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(s),
                                          torch.Generator().manual_seed(s + 1)]).tolist()[2] for s in seeds]
    assert batch == [alone(s) for s in seeds]
    assert len({tuple(t) for t in batch}) > 5  # the seed matters: outcomes vary across seeds


@pytest.mark.parametrize("soft_q", [False, True])
def test_a_seeded_row_emits_what_plain_sampling_draws_however_many_tokens_were_drafted(soft_q):
    """The draft-length policy sizes drafts by the batch: a seeded row's tokens must not depend on it. Its k-th
    token is its generator's k-th draw from p, as the sampler draws without speculation (and so p-distributed,
    whatever the drafts were or were drawn from)."""
    gen = torch.Generator().manual_seed(5)
    K, V = 4, 12
    p = random_dists(K + 1, V, gen, scale=0.5)  # flat: a wrong draft is often drawn over
    q = random_dists(K, V, gen, scale=0.5)[None] if soft_q else None
    for seed in range(30):
        plain_gen = torch.Generator().manual_seed(seed)
        plain = [int(draw_rows(p[k:k + 1], [plain_gen])[0]) for k in range(K + 1)]
        for n in range(K + 1):
            for wrong_at in range(n + 1):  # drafts equal to plain's tokens up to there, then one that is not
                draft = torch.tensor(plain[:K])
                if wrong_at < n:
                    draft[wrong_at] = (plain[wrong_at] + 1) % V
                out = rejection_sample(draft[None], [n], q, p[None], generators=[torch.Generator().manual_seed(seed)])
                assert out.tolist()[0] == plain[:wrong_at + 1], (seed, n, wrong_at)


def test_padded_from_packed_lays_each_sequence_in_its_row():
    counts = [2, 0, 3]
    packed = torch.arange(5 * 2).reshape(5, 2).float()  # rows 0-1: seq 0, rows 2-4: seq 2
    out = padded_from_packed(packed, counts, width=4)
    assert out.shape == (3, 4, 2)
    assert out[0, :2].tolist() == [[0, 1], [2, 3]] and out[0, 2:].abs().sum() == 0
    assert out[1].abs().sum() == 0
    assert out[2, :3].tolist() == [[4, 5], [6, 7], [8, 9]] and out[2, 3].abs().sum() == 0
    with pytest.raises(ValueError):
        padded_from_packed(packed, [2, 2])


def test_rejects_malformed_inputs():
    p = torch.full((2, 3, 4), 0.25)
    with pytest.raises(ValueError):
        rejection_sample(torch.zeros(2, 2, dtype=torch.long), [3, 0], None, p)  # a length beyond K
    with pytest.raises(ValueError):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), [1, 1], None, p)  # p not [B, K+1, V]
