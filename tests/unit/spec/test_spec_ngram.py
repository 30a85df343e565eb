"""The n-gram proposer on hand-built sequences, and against a literal reading of the rule on random ones."""

import random

import numpy as np
import pytest
import torch

from app.spec.ngram import NgramProposer
from app.spec.rejection import PLACEHOLDER_TOKEN_ID


def test_repeated_phrase_proposes_its_continuation():
    # "the cat sat on the mat . the cat" -> "sat on the"
    tokens = [10, 11, 12, 13, 10, 14, 15, 10, 11]
    assert NgramProposer(3, min_n=1, max_n=3).propose(tokens) == [12, 13, 10]


def test_no_match_proposes_nothing():
    assert NgramProposer(3).propose([1, 2, 3, 4, 5]) == []
    assert NgramProposer(3).propose([7]) == []
    assert NgramProposer(3).propose([]) == []
    # the last token only occurs as the last token: the suffix is not its own earlier occurrence
    assert NgramProposer(3).propose([1, 2, 3, 1, 2, 9]) == []


def test_prefers_the_longest_ngram_over_a_more_recent_shorter_one():
    # last 3 = [1, 2, 3] occurs at 0 (followed by 7, 8, 5); the 1-gram [3] occurs later, at 6 (followed by 9)
    tokens = [1, 2, 3, 7, 8, 5, 3, 9, 1, 2, 3]
    assert NgramProposer(3, min_n=1, max_n=3).propose(tokens) == [7, 8, 5]
    assert NgramProposer(3, min_n=1, max_n=1).propose(tokens) == [9, 1, 2]


def test_takes_the_most_recent_occurrence():
    tokens = [1, 2, 5, 1, 2, 6, 4, 1, 2]  # [1, 2] at 0 (then 5) and at 3 (then 6, 4)
    assert NgramProposer(2, min_n=2, max_n=2).propose(tokens) == [6, 4]


def test_min_n_k_and_the_end_of_the_sequence_bound_the_draft():
    tokens = [4, 8, 4]  # only a 1-gram matches
    assert NgramProposer(3, min_n=2, max_n=3).propose(tokens) == []
    assert NgramProposer(3, min_n=1, max_n=3).propose(tokens) == [8, 4]  # fewer than k: the sequence ends
    assert NgramProposer(3).propose([4, 4, 4]) == [4]  # [4, 4] at 0, followed only by the last token
    assert NgramProposer(5).propose([1, 2, 3, 4, 5, 6, 1, 2], k=2) == [3, 4]
    capped = NgramProposer(5, max_model_len=10)
    assert capped.propose([1, 2, 3, 4, 5, 6, 1, 2]) == [3, 4]  # 8 tokens + 2 reach max_model_len
    assert capped.propose(list(range(5)) * 2) == []  # already at max_model_len


def test_accepts_tensors_and_arrays():
    tokens = [3, 1, 4, 1, 5, 9, 3, 1]
    expected = NgramProposer(3).propose(tokens)
    assert expected == [4, 1, 5]
    assert NgramProposer(3).propose(torch.tensor(tokens)) == expected
    assert NgramProposer(3).propose(np.array(tokens, dtype=np.int32)) == expected


def test_propose_batch_pads_for_the_rejection_sampler():
    proposer = NgramProposer(4, min_n=1, max_n=2)
    seqs = [[1, 2, 3, 1, 2], [9, 8, 7], [5, 6, 5, 6, 5], [1, 2, 1]]
    draft, counts = proposer.propose_batch(seqs, k=[3, 4, 1, 0])
    assert draft.shape == (4, 4) and draft.dtype == torch.long
    assert counts.tolist() == [3, 0, 1, 0]  # [1, 2] at 0 is followed by 3 and then by the suffix itself
    assert draft.tolist() == [[3, 1, 2, PLACEHOLDER_TOKEN_ID],
                              [PLACEHOLDER_TOKEN_ID] * 4,
                              [6, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID, PLACEHOLDER_TOKEN_ID],
                              [PLACEHOLDER_TOKEN_ID] * 4]
    draft, counts = proposer.propose_batch(seqs)  # default: k = num_speculative_tokens for all
    assert draft.shape == (4, 4) and counts.tolist() == [3, 0, 2, 2]
    with pytest.raises(ValueError):
        proposer.propose_batch(seqs, k=[1, 2])


def literal_rule(tokens, k, min_n, max_n):
    """The rule as written: n from max_n down; the largest i < L - n with t[i:i+n] == t[L-n:]; t[i+n:i+n+k]."""
    L = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        for i in range(L - n - 1, -1, -1):
            if tokens[i:i + n] == tokens[L - n:]:
                return tokens[i + n:i + n + k]
    return []


def test_matches_the_literal_rule_on_random_sequences():
    rng = random.Random(0)
    found = 0
    for _ in range(400):
        alphabet = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        k, min_n = rng.randrange(1, 6), rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 3)
        got = NgramProposer(k, min_n=min_n, max_n=max_n).propose(tokens)
        assert got == literal_rule(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        found += bool(got)
    assert 50 < found < 400  # both outcomes were exercised
