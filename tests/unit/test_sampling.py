import pytest
import torch

from app.engine.request import Request, SamplingParams
from app.engine.sampling import Sampler, apply_penalties, draw_rows, truncated_probs


def _req(rid="r", **params):
    return Request(rid, [1, 2, 3], SamplingParams(**params), eos_token_ids=frozenset({0}))


def test_greedy_picks_argmax_per_row():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    assert Sampler().sample(logits, [_req("a", temperature=0), _req("b", temperature=0)]) == [1, 0]


def test_a_temperature_below_vllms_epsilon_is_greedy_as_there():
    logits = torch.tensor([[1.0, 1.0 + 1e-7, 0.0]] * 64)  # a near-tie: at 1e-5 a draw could take either
    reqs = [_req(str(i), temperature=1e-6, seed=i) for i in range(64)]
    assert all(r.sampling.greedy for r in reqs) and Sampler().sample(logits, reqs) == [1] * 64


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


def _reference_truncation(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's sampler, row by row over whole sorted rows: temperature; min-p against the top probability; then its
    ``apply_top_k_top_p_pytorch``: top-k, and top-p on the probabilities of what top-k left, renormalized (as HF's
    warpers chain them). The definition the sampler's partial sort must match."""
    out = []
    for row, p in zip(logits, params):
        scaled = row / max(p.temperature, 1e-5)
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
        ascending, order = scaled.sort()
        if p.top_k:
            ascending = ascending.masked_fill(ascending < ascending[-p.top_k], float("-inf"))
        if p.top_p < 1:  # (at 1, a cumulative sum passing 1.0 by rounding must not drop the tail)
            dropped = ascending.softmax(-1).cumsum(-1) <= 1 - p.top_p
            dropped[-1] = False  # at least one
            ascending = ascending.masked_fill(dropped, float("-inf"))
        out.append(torch.empty_like(ascending).scatter_(0, order, ascending).softmax(-1))
    return torch.stack(out)


def test_truncation_keeps_what_a_full_sort_keeps_without_sorting_whole_rows():
    torch.manual_seed(3)
    V = 2000  # past the 256 candidates the sampler ranks first
    logits = torch.cat([torch.randn(6, V) * 4, torch.randn(2, V) * 0.05, torch.randn(3, V)])  # peaked, nearly flat, between
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(top_k=40),
              SamplingParams(temperature=1.3, top_p=0.5, top_k=100, min_p=0.05), SamplingParams(min_p=0.1),
              SamplingParams(top_k=1000), SamplingParams(top_p=0.95),  # flat: the nucleus runs past the candidates
              SamplingParams(top_p=0.3, top_k=1500),
              # top-p over what min-p or top-k left (Qwen2.5's defaults: 0.7 / 0.8 / 20): less than over the whole row
              SamplingParams(temperature=0.7, top_p=0.8, top_k=20), SamplingParams(top_p=0.6, min_p=0.3),
              SamplingParams(top_p=0.9, top_k=600)]
    got = truncated_probs(logits.clone(), [Request(str(i), [1], p) for i, p in enumerate(params)])
    want = _reference_truncation(logits, params)
    assert torch.equal(got > 0, want > 0)  # the same tokens kept
    assert torch.allclose(got, want, atol=1e-6)
    assert (want > 0).sum(-1).tolist()[5:7] == [1000, int((want[6] > 0).sum())] and int((want[6] > 0).sum()) > 256
    # logits with ties (bf16 rounds them alike often): top-k keeps every token tied with the k-th, as vLLM and HF do
    tied = (torch.randn(3, V) * 2).round()
    params = [SamplingParams(top_k=5), SamplingParams(top_k=300),  # ties past the first window too
              SamplingParams(top_k=30, min_p=0.01)]  # (which of tied tokens a top-p keeps is any order's: not here)
    got = truncated_probs(tied.clone(), [Request(str(i), [1], p) for i, p in enumerate(params)])
    want = _reference_truncation(tied, params)
    assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, atol=1e-6) and int((want[0] > 0).sum()) > 5
    # a vocabulary past the second window too: nuclei inside it (3k tokens) and past it (5k: the whole row sorted)
    flat = torch.randn(2, 6000) * 0.05
    params = [SamplingParams(top_p=0.5), SamplingParams(top_p=0.9)]
    got = truncated_probs(flat.clone(), [Request(str(i), [1], p) for i, p in enumerate(params)])
    want = _reference_truncation(flat, params)
    assert torch.equal(got > 0, want > 0) and torch.allclose(got, want, atol=1e-6)
    assert 256 < int((want[0] > 0).sum()) < 4096 < int((want[1] > 0).sum())


def test_draw_rows_draws_in_proportion_to_unnormalized_weights_and_never_a_zero_weight():
    weights = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0]]).repeat(40_000, 1)
    tokens = draw_rows(weights, [None] * len(weights))
    counts = torch.bincount(tokens, minlength=5).double() / len(tokens)
    assert counts[0] == counts[2] == counts[4] == 0
    assert abs(float(counts[3]) - 0.75) < 0.02  # 10 standard deviations of 40k draws: a real failure, not noise
    seeded = [torch.Generator().manual_seed(5) for _ in range(2)]
    assert draw_rows(weights[:1], seeded[:1]).item() == draw_rows(weights[:3], [None, seeded[1], None])[1].item()


def test_logit_bias_moves_the_choice_and_logprobs_stay_the_models():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    biased = _req("biased", temperature=0, logit_bias={"2": 10.0, "1": -100}, logprobs=0)  # as the API passes it
    plain = _req("plain", temperature=0, logprobs=0)
    tokens, logprobs = Sampler().sample_with_logprobs(logits.clone(), [biased, plain])
    assert tokens == [2, 1]
    raw = logits[0].log_softmax(-1)
    assert abs(logprobs[0].logprob - float(raw[2])) < 1e-6  # the model's own distribution, as OpenAI reports it
    assert biased.sampling.logit_bias == ((1, -100.0), (2, 10.0))


def test_logit_bias_out_of_range_is_refused():
    import pytest

    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})


def test_a_row_of_nan_logits_raises_rather_than_giving_a_token():
    """NaN logits have no token to give: the sampler raises, and the runner then samples the batch-mates again without
    that request (app/engine/runner.py: _isolated). A token id from a NaN row would be garbage, or past the vocabulary."""
    logits = torch.tensor([[0.0, 5.0, 1.0], [float("nan")] * 3])
    for temperature in (0.0, 1.0):
        requests = [_req("a", temperature=temperature), _req("b", temperature=temperature)]
        with pytest.raises(ValueError, match="no token can be"):
            Sampler().sample(logits.clone(), requests)
        alone = Sampler().sample(logits[:1].clone(), requests[:1])  # the finite row, without its batch-mate
        assert alone == [1] if temperature == 0 else 0 <= alone[0] < 3
    with pytest.raises(ValueError, match="no token can be drawn"):
        draw_rows(torch.tensor([[0.5, 0.5], [0.0, 0.0]]), [None, None])


def test_a_row_sampled_again_after_its_batch_mate_failed_reports_the_logprobs_it_has_alone():
    """The min_tokens mask (EOS, token 0 here, is the top choice) must not reach the rows the runner samples again:
    the logprobs are the model's raw distribution's, EOS among the top ones, in the batch or not."""
    logits = torch.tensor([[3.0, 0.0, 1.0, 2.0], [float("nan")] * 4])
    request = _req("a", temperature=0, min_tokens=2, max_tokens=4, logprobs=2)
    expected = Sampler().sample_with_logprobs(logits[:1].clone(), [request])
    rows = logits.clone()
    with pytest.raises(ValueError, match="no token can be"):
        Sampler().sample_with_logprobs(rows, [request, _req("b", temperature=0)])
    tokens, [logprob] = Sampler().sample_with_logprobs(rows[:1], [request])  # as runner._isolated does
    assert (tokens, [logprob]) == expected and logprob.top[0][0] == 0


def test_penalties_come_in_vllms_order_repetition_first_then_frequency_and_presence():
    request = Request("r", [3], SamplingParams(temperature=0, repetition_penalty=2.0, presence_penalty=1.5))
    request.output_token_ids = [0, 1]
    logits = torch.tensor([[3.0, 1.0, 0.5, -1.0]])
    penalized = apply_penalties(logits.clone(), [request])
    # repetition on the raw logits (3 / 2, 1 / 2, -1 * 2), then presence on the output's tokens (0 and 1)
    assert penalized.tolist() == [[0.0, -1.0, 0.5, -2.0]]
    assert Sampler().sample(logits.clone(), [request]) == [2]


def test_seed_minus_one_means_no_seed_as_in_vllm_and_a_choices_seed_of_minus_one_is_a_seed():
    from app.api.fanout import Prepared, fan_out
    from app.api.protocol import CompletionRequest, parse_body

    def seeds(seed: int, n: int) -> list:
        params = parse_body({"prompt": "a", "seed": seed, "n": n}, CompletionRequest).sampling_params(4)
        return [plan.sampling.seed for plan in fan_out([Prepared("r", [1], params, 0, "m", None)], n, n, None)]

    assert seeds(-1, 1) == [None] and seeds(-2, 3) == [-2, -1, 0]  # choice 1's -1 is seed + 1, not "no seed"


def test_seeds_differing_only_above_32_bits_draw_differently():
    """A CPU generator keeps 32 bits of its seed: the seed is mixed down first, so 5 and 5 + 2**32 (or a choice's
    seed + j crossing 2**32, or -2 against 2**64 - 2) are not the same stream."""
    logits = torch.zeros(1, 1000)
    draws = {seed: [Sampler().sample(logits.clone(), [_req("x", temperature=1.0, seed=seed)])[0] for _ in range(1)]
             for seed in (5, 5 + 2**32, -2, 2**32 - 2, 0, -2**63)}
    assert draws[5] != draws[5 + 2**32] and draws[-2] != draws[2**32 - 2] and draws[0] != draws[-2**63]


def test_the_most_likely_token_survives_any_top_p():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    for top_p in (1e-46, 1e-300, 5e-324):
        assert Sampler().sample(logits.clone(), [_req(temperature=1.0, top_p=top_p)]) == [1]


def test_min_tokens_bans_eos_even_under_ignore_eos_as_vllm():
    logits = torch.tensor([[10.0, 0.0, 1.0]])
    assert Sampler().sample(logits, [_req(temperature=0, min_tokens=2, max_tokens=4, ignore_eos=True)]) == [2]
