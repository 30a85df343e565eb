"""vLLM's ``allowed_token_ids`` and ``bad_words``: in the sampler, in speculative verification (each draft position
sees the drafts before it), and as the serving layer reads them (tokenized as vLLM tokenizes them, checked against the
vocabulary)."""

import pytest
import torch

from app.api import extras
from app.api.errors import APIError
from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from app.api.errors import to_api_error
from app.engine.errors import engine_failure
from app.engine.request import Request, SamplingParams
from app.engine.runner import _isolated
from app.engine.sampling import NoTokenLeftError, Sampler, mixed_seed
from app.engine.scheduler import ScheduledRequest
from app.spec.verify import verify_drafts

V = 8


def _req(rid="r", output=(), **params):
    request = Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, **params), eos_token_ids=frozenset({0}))
    request.output_token_ids = list(output)
    return request


def test_allowed_token_ids_leave_only_those_to_choose_and_logprobs_stay_the_models():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0, 2.0, 0.5, 0.1, 0.2]] * 2)
    allowed = _req("allowed", temperature=0, allowed_token_ids=[2, 4, 6], logprobs=1)
    plain = _req("plain", temperature=0, logprobs=1)
    tokens, logprobs = Sampler().sample_with_logprobs(logits.clone(), [allowed, plain])
    assert tokens == [4, 1]  # the best of the allowed; its batch-mate untouched
    raw = logits[0].log_softmax(-1)
    assert abs(logprobs[0].logprob - float(raw[4])) < 1e-6 and logprobs[0].top[0][0] == 1  # the model's distribution
    sampled = [_req(f"s{i}", temperature=1.5, seed=i, allowed_token_ids=[2, 6]) for i in range(40)]
    drawn = Sampler().sample(logits[:1].repeat(40, 1), sampled)
    assert set(drawn) == {2, 6}  # both drawn, nothing else


def test_a_bad_word_of_one_token_is_never_chosen_and_a_longer_one_only_after_its_start():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 3.0, 0.0, 0.0, 0.0]])  # 3 is the model's choice
    words = [(5, 6, 3), (4,)]
    fresh = _req("fresh", temperature=0, bad_words_token_ids=words)
    after_part = _req("part", output=[6], temperature=0, bad_words_token_ids=words)
    after_start = _req("start", output=[1, 5, 6], temperature=0, bad_words_token_ids=words)
    assert Sampler().sample(logits.clone(), [fresh]) == [3]
    assert Sampler().sample(logits.clone(), [after_part]) == [3]  # 6 alone is not the word's start
    assert Sampler().sample(logits.clone(), [after_start]) == [2]  # 3 would finish 5 6 3; 4 is banned everywhere


def test_verification_bans_a_bad_word_at_the_draft_position_that_would_finish_it():
    """Greedy; the bad word is 5 6 3. The position after the drafts 3 5 6 sees 5 6 before it: the target's choice there
    is its next best, not 3."""
    rows = torch.tensor([[0.0, 1.0, 2.0, 9.0, 0.0, 8.0, 7.0, 0.0]] * 4)  # [n + 1, V]: 3, then 5, then 6 by the logits
    request = _req("v", temperature=0, bad_words_token_ids=[(5, 6, 3)])
    emitted, accepted = verify_drafts(rows.clone(), [request], [[3, 5, 6]], [None])
    assert accepted == [1] and emitted == [[3, 3]]  # the second position prefers 3 over the drafted 5
    rows[1, 3] = rows[2, 3] = rows[2, 5] = 0.0  # now 5 is the target's choice after 3, and 6 after 3 5 ...
    emitted, accepted = verify_drafts(rows.clone(), [request], [[3, 5, 6]], [None])
    assert accepted == [3] and emitted == [[3, 5, 6, 5]]  # ... and after 5 6, 3 is banned: its next best


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_reads_them():
    class Words:  # " cat" a token of its own, as in BPE vocabularies; " dog" a space, then "dog"
        ids = {"cat": [1], " cat": [2], "big": [3], " big": [4], "cat,": [1, 5], " cat,": [2, 5], "dog": [6], " dog": [7, 6]}

        def encode(self, text, add_special_tokens=True):
            return self.ids.get(text, [])

    assert extras.bad_words_token_ids(Words(), ["cat", "  big", "cat,", "dog"]) == (
        (1,), (2,), (3,), (4,), (1, 5), (2, 5), (6,))
    with pytest.raises(APIError) as caught:
        extras.bad_words_token_ids(Words(), ["cat", "   "])
    assert caught.value.param == "bad_words"


@pytest.mark.parametrize("body, param", [
    ({"allowed_token_ids": [65, 256]}, "allowed_token_ids"),  # past the fake model's 256 bytes
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"bad_words": [" "]}, "bad_words"),
])
async def test_what_cannot_be_honoured_is_a_400_naming_the_field(tools_server, body, param):
    with pytest.raises(APIError) as caught:
        await tools_server.serving.completion(parse_body({"prompt": "abc", "max_tokens": 2, **body}, CompletionRequest))
    assert caught.value.status == 400 and caught.value.param.startswith(param)


async def test_vllms_defaults_for_beam_search_and_special_token_spacing_are_taken(tools_server):
    body = {"prompt": "abc", "max_tokens": 2, "use_beam_search": False, "length_penalty": 1.0,
            "spaces_between_special_tokens": False, "allowed_token_ids": [97, 98], "bad_words": ["zz"]}
    answer = await tools_server.serving.completion(parse_body(body, CompletionRequest))
    assert answer["choices"][0]["finish_reason"] == "length"


CONTINUED = {"messages": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi th"}],
             "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 4, "echo": True}


async def test_chat_echo_starts_the_answer_with_the_message_it_continues_streamed_or_not(tools_server):
    serving = tools_server.serving
    plain = await serving.chat(parse_body({**CONTINUED, "echo": False}, ChatCompletionRequest))
    echoed = await serving.chat(parse_body(CONTINUED, ChatCompletionRequest))
    assert echoed["choices"][0]["message"]["content"] == "Hi th" + plain["choices"][0]["message"]["content"]
    assert echoed["usage"] == plain["usage"]  # the echo is not generated
    chunks = [c async for c in serving.chat_stream(parse_body({**CONTINUED, "stream": True}, ChatCompletionRequest))]
    deltas = [choice["delta"].get("content") for c in chunks for choice in c["choices"]]
    assert deltas[:2] == ["", "Hi th"]  # the role's chunk, then the echo's, then the answer
    assert "".join(d or "" for d in deltas) == echoed["choices"][0]["message"]["content"]
    user_last = {**CONTINUED, "messages": CONTINUED["messages"][:1], "continue_final_message": False,
                 "add_generation_prompt": True}
    assert (await serving.chat(parse_body(user_last, ChatCompletionRequest)))["choices"][0]["message"]["content"] == (
        (await serving.chat(parse_body({**user_last, "echo": False}, ChatCompletionRequest)))["choices"][0]["message"]["content"])


def test_a_completions_text_prompt_leaves_out_the_tokenizers_bos_when_asked():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from app.api.prompts import Prompts

    inner = Tokenizer(models.WordLevel({"<s>": 0, "[UNK]": 1, "hi": 2, "there": 3}, unk_token="[UNK]"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    prompts = Prompts(PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>"), "m", 64, 4)
    assert prompts.completion("hi there") == [[0, 2, 3]]
    assert prompts.completion(["hi there", "hi"], add_special_tokens=False) == [[2, 3], [2]]
    assert parse_body({"prompt": "hi"}, CompletionRequest).add_special_tokens is True  # vLLM's default for completions


def test_where_every_token_is_banned_the_request_fails_alone_with_or_without_drafts():
    """allowed 3 and 4; after a 3, both are bad words: no token is left. The sampler raises the request's own error (the
    runner then fails it alone); its batch-mate is unaffected. Verification past an accepted draft 3 emits the 3 as
    the step's own token (a stop there ends the request; else its next step samples that position and fails it); at
    the first position it raises."""
    stuck = dict(temperature=0, allowed_token_ids=[3, 4], bad_words_token_ids=[(3, 3), (3, 4)])
    logits = torch.zeros(2, V)
    with pytest.raises(NoTokenLeftError, match="request stuck.*output token 2"):
        Sampler().sample(logits.clone(), [_req("stuck", output=[3], **stuck), _req("fine", temperature=0)])
    rows = torch.zeros(2, V)
    rows[:, 3] = 30.0  # the target takes the drafted 3 (greedy: its choice; sampled: all but certainly)
    for sampling in ({}, {"temperature": 1.0, "seed": 1}):  # greedy, sampled
        assert verify_drafts(rows.clone(), [_req("stuck", **{**stuck, **sampling})], [[3]], [None]) == ([[3]], [0])
    with pytest.raises(NoTokenLeftError, match="output token 2"):  # no draft before the position: nothing can finish it
        verify_drafts(rows.clone(), [_req("stuck", output=[3], **stuck)], [[]], [None])
    assert verify_drafts(torch.zeros(2, V), [_req("fine", temperature=0)], [[0]], [None]) == ([[0, 0]], [1])


def test_a_batch_that_fails_puts_each_seeded_generator_back_before_its_requests_run_alone():
    """A batched call can draw for one seeded request and then raise for another: run alone after, the first draws
    what it would have drawn alone."""
    sampler = Sampler()
    seeded, failing = _req("seeded", temperature=1.0, seed=11), _req("failing", temperature=1.0, seed=3)
    for request in (seeded, failing):
        sampler.admit(request, torch.device("cpu"))

    def draws(rows, items):
        out = [torch.rand(1, generator=sampler.generator_for(item.request, rows.device)).item() for item in items]
        if any(item.request is failing for item in items):
            raise ValueError("no token can be drawn")
        return out

    alone = torch.rand(1, generator=torch.Generator().manual_seed(mixed_seed(11))).item()  # its generator's first draw
    batch = [ScheduledRequest(seeded, 1), ScheduledRequest(failing, 1)]
    results = _isolated(draws, torch.zeros(2, V), batch, sampler)
    assert results[0] == alone and results[1].startswith("ValueError")


@pytest.mark.parametrize(("body", "param"), [
    ({"allowed_token_ids": [97], "bad_words": ["a"]}, "allowed_token_ids"),  # the fake model: one byte a token
    ({"allowed_token_ids": [97], "stop_token_ids": [97], "min_tokens": 1}, "allowed_token_ids"),
    ({"stop_token_ids": "every token", "min_tokens": 1}, "stop_token_ids"),
    ({"allowed_token_ids": "EOS", "min_tokens": 1, "ignore_eos": True}, "allowed_token_ids"),  # banned under it too
])
async def test_bans_that_leave_no_token_are_a_400_before_any_work(tools_server, body, param):
    if body.get("stop_token_ids") == "every token":
        body = {**body, "stop_token_ids": list(range(tools_server.serving.vocab_size))}
    if body.get("allowed_token_ids") == "EOS":
        body = {**body, "allowed_token_ids": sorted(tools_server.serving.eos_token_ids)}
    with pytest.raises(APIError) as caught:
        await tools_server.serving.completion(parse_body({"prompt": "abc", "max_tokens": 2, **body}, CompletionRequest))
    assert (caught.value.status, caught.value.param, caught.value.code) == (400, param, "no_token_left")


def test_a_request_the_engine_finds_with_no_token_left_is_a_400_naming_why():
    failure = engine_failure("NoTokenLeftError: request cmpl-1-0: its allowed_token_ids, bad_words, min_tokens' stop "
                             "tokens and format together ban every token at output token 3")
    error = to_api_error(failure, "cmpl-1")
    assert (error.status, error.code) == (400, "no_token_left") and "output token 3" in error.message
    assert "cmpl-1-0" not in error.message


def test_a_position_past_a_rejected_draft_may_have_no_token_left_without_failing_the_request():
    """Allowed 0-3; after a 2 every allowed token is a bad word. The target prefers 1, so a drafted 2 is rejected at the
    first position and the next one, where nothing is left, is never reached: greedy or sampled, the request goes on
    (without drafts it would never have chosen 2). A 2 the target does choose is emitted as the step's own token: a stop
    may end the request there, else its next step finds nothing left and fails it."""
    bans = dict(allowed_token_ids=[0, 1, 2, 3], bad_words_token_ids=[(2, 0), (2, 1), (2, 2), (2, 3)])
    rows = torch.tensor([[0.0, 30.0, -30.0, 0.0, 0, 0, 0, 0]] * 2)
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        assert verify_drafts(rows.clone(), [_req("r", **bans, **sampling)], [[2]], [None]) == ([[1]], [0])
    rows[0] = torch.tensor([0.0, -30.0, 30.0, 0.0, 0, 0, 0, 0])  # now the target prefers 2 too
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=5)):  # the 2 alone: a stop may end it there
        assert verify_drafts(rows.clone(), [_req("r", **bans, **sampling)], [[2]], [None]) == ([[2]], [0])
