"""processed_probs gives the distribution the engine's own sampler draws from, at every draft position."""

import dataclasses

import torch

from app.engine.request import Request, SamplingParams
from app.engine.sampling import Sampler, mixed_seed
from app.spec.probs import processed_probs
from app.spec.rejection import rejection_sample


def _req(rid, output=(), **params):
    request = Request(rid, [5, 6, 7], SamplingParams(max_tokens=64, **params), eos_token_ids=frozenset({0}))
    request.output_token_ids = list(output)
    return request


def test_no_draft_reproduces_the_engine_sampler_token_for_token():
    # Seeded sampled requests with every kind of processing: rejection_sample with nothing drafted must
    # draw the same token as Sampler, from the same generator, which it can only do from the same p.
    torch.manual_seed(0)
    V = 64
    requests = [
        _req("a", output=[3, 3, 9], temperature=0.7, top_p=0.8, seed=11, frequency_penalty=0.5),
        _req("b", temperature=1.3, top_k=5, seed=12, presence_penalty=1.0, output=[4]),
        _req("c", temperature=0.9, min_p=0.1, seed=13, repetition_penalty=1.3, output=[1, 2]),
        _req("d", temperature=0.0, output=[8]),
        _req("e", temperature=1.0, seed=14, min_tokens=3, output=[2]),
    ]
    seen = set()
    for trial in range(30):
        logits = torch.randn(len(requests), V) * 3
        expected = Sampler().sample(logits.clone(), requests)  # a fresh Sampler: fresh seeded generators
        p = processed_probs(logits, requests)  # [B, V]
        gens = [torch.Generator().manual_seed(mixed_seed(r.sampling.seed)) if r.sampling.seed is not None else None
                for r in requests]
        out = rejection_sample(torch.zeros(len(requests), 0, dtype=torch.long), [0] * len(requests), None,
                               p.unsqueeze(1), is_greedy=[r.sampling.greedy for r in requests], generators=gens)
        got = out.token_ids[:, 0].tolist()
        assert got == expected, trial
        seen.update(enumerate(got))
    assert len(seen) > 30  # the tokens vary: the comparison is not between constants


def test_each_position_sees_the_drafts_before_it():
    # position j is processed as if the request had already emitted draft[:j]: compare with the sampler
    # run on such a request (greedy, where the sampler's choice is its whole distribution), and by hand
    V = 6
    base = _req("g", temperature=0.0, presence_penalty=1.0, min_tokens=2)
    logits = torch.tensor([[[5.0, 2.0, 1.5, 0.8, 0.0, 0.0]] * 4])  # [1, 4, V]: eos (0) best everywhere
    draft = torch.tensor([[1, 2, 3]])
    probs = processed_probs(logits, [base], draft, num_draft_tokens=[3])  # [1, 4, V]
    for j in range(4):
        moved = dataclasses.replace(base, output_token_ids=base.output_token_ids + draft[0, :j].tolist())
        token = Sampler().sample(logits[0, j:j + 1].clone(), [moved])[0]
        assert probs[0, j].tolist() == torch.nn.functional.one_hot(torch.tensor(token), V).float().tolist()
    # by hand: 0: eos banned (0 outputs < min_tokens) -> 1; 1: eos banned, 1 penalised to 1.0 < 1.5 -> 2;
    # 2 and 3: two outputs, eos allowed -> 0
    assert probs[0].argmax(-1).tolist() == [1, 2, 0, 0]


def test_sampled_positions_and_padding():
    V = 10
    request = _req("s", temperature=1.0, frequency_penalty=1.0)
    logits = torch.zeros(1, 3, V)
    draft = torch.tensor([[4, -1]])  # one real draft token; -1 is padding and must not be counted
    probs = processed_probs(logits, [request], draft, num_draft_tokens=[1])
    assert torch.allclose(probs.sum(-1), torch.ones(1, 3))
    assert torch.allclose(probs[0, 0], torch.full((V,), 0.1))  # nothing emitted yet: uniform
    for j in (1, 2):  # token 4 once counted: exp(-1) against 1 for the others
        expected = torch.ones(V)
        expected[4] = torch.exp(torch.tensor(-1.0))
        assert torch.allclose(probs[0, j], expected / expected.sum())


def test_vocab_size_removes_padding_ids():
    request = _req("v", temperature=1.0)
    logits = torch.zeros(2, 8)
    probs = processed_probs(logits, [request, dataclasses.replace(request, request_id="w")], vocab_size=5)
    assert probs[:, 5:].abs().sum() == 0 and torch.allclose(probs[:, :5], torch.full((2, 5), 0.2))


def test_greedy_verification_of_bf16_logits_picks_the_samplers_token():
    """A bf16 model (a GPU's default) hands bf16 logits to both paths: the sampler upcasts before penalties, so the
    verifier must too, or a penalty rounds differently (20.25 vs 20.0, frequency penalty 0.3 on the first)."""
    from app.spec.verify import verify_drafts

    logits = torch.full((1, 10), -5.0)
    logits[0, 3], logits[0, 4] = 20.25, 20.0
    logits = logits.to(torch.bfloat16)
    plain = Sampler().sample(logits.clone(), [_req("p", output=[3], temperature=0, frequency_penalty=0.3)])
    emitted, _ = verify_drafts(logits.clone(), [_req("s", output=[3], temperature=0, frequency_penalty=0.3)], [[]], [None])
    assert emitted == [plain] and plain == [4]
