import torch

from app.engine.request import Request, SamplingParams
from app.engine.sampling import Sampler


def _req(rid="r", **params):
    return Request(rid, [1, 2, 3], SamplingParams(**params), eos_token_ids=frozenset({0}))


def test_greedy_picks_argmax_per_row():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    assert Sampler().sample(logits, [_req("a", temperature=0), _req("b", temperature=0)]) == [1, 0]


def test_top_k_one_equals_greedy_even_when_sampling():
    logits = torch.randn(4, 50)
    reqs = [_req(str(i), temperature=1.0, top_k=1) for i in range(4)]
    assert Sampler().sample(logits.clone(), reqs) == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    logits = torch.randn(1, 100)
    alone = [Sampler().sample(logits.clone(), [_req("x", temperature=1.0, seed=7)])[0] for _ in range(3)]
    batch = Sampler().sample(torch.cat([torch.randn(1, 100), logits]), [_req("y", temperature=1.0), _req("x", temperature=1.0, seed=7)])
    assert len(set(alone)) == 1 and batch[1] == alone[0]


def test_min_tokens_bans_eos():
    logits = torch.tensor([[10.0, 0.0, 1.0]])
    assert Sampler().sample(logits, [_req(temperature=0, min_tokens=2, max_tokens=4)]) == [2]


def test_presence_penalty_moves_choice():
    request = _req(temperature=0, presence_penalty=2.0)
    request.output_token_ids = [1]
    logits = torch.tensor([[0.0, 2.0, 1.5]])
    assert Sampler().sample(logits, [request]) == [2]


def test_top_p_keeps_only_nucleus():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler()
    draws = {sampler.sample(logits.clone(), [_req(str(i), temperature=1.0, top_p=0.5)])[0] for i in range(30)}
    assert draws == {0}


def test_logprobs_are_the_raw_distribution_with_sorted_alternatives():
    logits = torch.tensor([[2.0, 0.5, 1.0, -1.0], [0.0, 3.0, 0.0, 0.0]])
    asking = Request("a", [1], SamplingParams(temperature=0, logprobs=2))
    silent = Request("b", [1], SamplingParams(temperature=0))
    tokens, logprobs = Sampler().sample_with_logprobs(logits, [asking, silent])
    expected = logits[0].log_softmax(-1)
    assert tokens == [0, 1] and logprobs[1] is None
    assert logprobs[0].token_id == 0 and abs(logprobs[0].logprob - float(expected[0])) < 1e-6
    assert [t for t, _ in logprobs[0].top] == [0, 2]
    assert abs(logprobs[0].top[1][1] - float(expected[2])) < 1e-6
