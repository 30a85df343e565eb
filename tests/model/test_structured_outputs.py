"""Structured outputs in the engine: every constrained output follows its grammar, a constrained request's
tokens do not depend on its batch-mates, and free-text batch-mates are untouched by their neighbours' masks."""

import json
import re

import pytest
import torch

from app.api.structured import request_grammar
from app.config import SpecConfig
from app.engine import Request, SamplingParams
from tests.model.conftest import make_engine, run_engine

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}
JSON = request_grammar({"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}, None)
PHONE = request_grammar(None, {"regex": "[0-9]{3}-[0-9]{4}"})
MOOD = request_grammar(None, {"choice": ["positive", "negative", "neutral"]})
PROMPTS = [
    "<|im_start|>user\nDescribe Paris as JSON.<|im_end|>\n<|im_start|>assistant\n",
    "The largest city in Japan is",
    "Phone number:",
    "Review: 'The food was cold.' Sentiment:",
]


def _requests(loaded, constrained: bool, temperature: float = 0.0) -> list[Request]:
    grammars = [JSON, JSON, PHONE, MOOD] if constrained else [None] * 4
    return [Request(f"{i}-{constrained}", loaded.tokenizer.encode(p),
                    SamplingParams(max_tokens=40, temperature=temperature, seed=7, grammar=g), loaded.eos_token_ids)
            for i, (p, g) in enumerate(zip(PROMPTS, grammars))]


def _texts(loaded, requests: list[Request], outputs: dict) -> list[str]:
    return [loaded.tokenizer.decode([t for t in outputs[r.request_id] if t not in loaded.eos_token_ids]) for r in requests]


def _assert_follow_their_grammars(texts: list[str]) -> None:
    for text in texts[:2]:
        value = json.loads(text)
        assert list(value) == ["city", "population_millions", "capital"], text  # in the schema's order
        assert len(value["city"]) <= 20 and 0 <= value["population_millions"] <= 100 and isinstance(value["capital"], bool)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[2]), texts[2]
    assert texts[3] in ("positive", "negative", "neutral"), texts[3]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_follow_their_grammars_and_equal_their_lone_runs(loaded_rounded, temperature):
    batch = _requests(loaded_rounded, True, temperature) + _requests(loaded_rounded, False, temperature)
    together = run_engine(make_engine(loaded_rounded), batch)
    constrained = batch[:4]
    _assert_follow_their_grammars(_texts(loaded_rounded, constrained, together))
    assert [r.status.finish_reason for r in constrained] == ["stop"] * 4  # each grammar ended with EOS
    alone = make_engine(loaded_rounded)
    for request in (batch[0], batch[3], batch[4]):  # JSON, a choice, free text: each alone, as a fresh request
        again = Request(request.request_id, request.prompt_token_ids, request.sampling, request.eos_token_ids)
        assert run_engine(alone, [again])[again.request_id] == together[request.request_id], request.request_id


def test_a_grammar_the_engine_cannot_use_fails_that_request_alone(loaded_rounded):
    engine = make_engine(loaded_rounded)
    broken = Request("broken", loaded_rounded.tokenizer.encode("Hi"),
                     SamplingParams(max_tokens=4, temperature=1.0, seed=3, grammar="start: /(ab/"), loaded_rounded.eos_token_ids)
    fine = _requests(loaded_rounded, True)[3]
    engine.add_requests([broken, fine])
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    assert outputs["broken"].finish_reason == "error" and "grammar" in outputs["broken"].error
    assert outputs[fine.request_id].finish_reason == "stop"
    assert engine.runner.sampler._generators == {}  # the refused request's seeded generator did not outlive it


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_complete_grammar_ends_the_output_even_before_min_tokens(loaded_rounded, temperature):
    """A choice is complete after one word: only EOS may follow, so min_tokens yields to the grammar (the request
    stops with its choice) rather than leaving no token to choose."""
    request = Request("mood", loaded_rounded.tokenizer.encode(PROMPTS[3]),
                      SamplingParams(max_tokens=12, min_tokens=10, temperature=temperature, seed=1, grammar=MOOD),
                      loaded_rounded.eos_token_ids)
    engine = make_engine(loaded_rounded)
    engine.add_requests([request])
    finished = [out for _ in range(40) if engine.has_unfinished_requests() for out in engine.step() if out.finished]
    assert [(out.finish_reason, out.error) for out in finished] == [("stop", None)]
    assert _texts(loaded_rounded, [request], {"mood": request.output_token_ids})[0] in ("positive", "negative", "neutral")


@pytest.mark.parametrize("stop, kept", [("-", ""), ("-", "-")])
def test_a_stop_string_beside_a_grammar_ends_the_output_where_it_appears(loaded_rounded, stop, kept):
    """As OpenAI and vLLM take it: the phone number's grammar holds the output, and its "-" ends it there, short of
    the grammar (with include_stop_str_in_output, after it)."""
    sampling = SamplingParams(max_tokens=12, temperature=0, grammar=PHONE, stop=(stop,), include_stop_str_in_output=bool(kept))
    request = Request("phone", loaded_rounded.tokenizer.encode(PROMPTS[2]), sampling, loaded_rounded.eos_token_ids)
    engine = make_engine(loaded_rounded)
    engine.add_requests([request])
    finished = [out for _ in range(40) if engine.has_unfinished_requests() for out in engine.step() if out.finished]
    assert [(out.finish_reason, out.error) for out in finished] == [("stop", None)]
    text = loaded_rounded.tokenizer.decode(request.output_token_ids)
    assert re.fullmatch("[0-9]{3}-", text[:4]), text  # the grammar held it up to the stop string
    assert engine.outputs._detokenizers == {}  # and its detokenizer went with it


def test_with_ngram_drafts_constrained_outputs_equal_the_targets_own_and_drafts_are_kept(loaded_rounded):
    """Drafts are tried on each request's grammar and rolled back; every verified position is masked as its grammar
    stands there, so greedy output is the constrained target's own, and drafts the grammar allows are accepted."""
    example = '{"city": "Paris", "population_millions": 2, "capital": true}'
    prompts = [f"Example: {example}\nAnother one, as JSON: ", f"JSON for Paris: {example}\nJSON for Lyon: ",
               "Phone numbers: 555-1234, 555-1234, 555-"]

    def requests() -> list[Request]:
        return [Request(str(i), loaded_rounded.tokenizer.encode(p), SamplingParams(max_tokens=32, temperature=0, grammar=g),
                        loaded_rounded.eos_token_ids) for i, (p, g) in enumerate(zip(prompts, [JSON, JSON, PHONE]))]

    plain = run_engine(make_engine(loaded_rounded, max_model_len=512), requests())
    engine = make_engine(loaded_rounded, max_model_len=512, speculative=SpecConfig(drafter="ngram", num_speculative_tokens=4))
    assert run_engine(engine, requests()) == plain
    stats = engine.stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats


def test_a_request_that_comes_with_output_continues_its_grammar_from_there(loaded_rounded):
    """A draft call carries the target's output so far: the draft model's grammar stands where that output is, so
    its greedy proposals are the target's own continuation (it shares the target's weights here), not the grammar's
    first tokens."""
    prompt = loaded_rounded.tokenizer.encode("Write the numbers:")
    counting = request_grammar(None, {"regex": "one two three four five six seven eight nine ten"})
    sampling = SamplingParams(max_tokens=24, temperature=0, grammar=counting)
    whole = run_engine(make_engine(loaded_rounded, max_model_len=512), [Request("whole", list(prompt), sampling, loaded_rounded.eos_token_ids)])["whole"]
    start = 3
    continued = Request("continued", list(prompt), sampling, loaded_rounded.eos_token_ids, output_token_ids=whole[:start])
    assert run_engine(make_engine(loaded_rounded, max_model_len=512), [continued])["continued"] == whole  # max_tokens counts it


def test_preemption_keeps_each_grammar_where_its_output_is(loaded_rounded):
    """A preempted request recomputes its KV, not its tokens: its matcher stays where its output is."""
    def requests(tag: str) -> list[Request]:
        return [Request(f"{tag}{i}", loaded_rounded.tokenizer.encode(p)[:40], SamplingParams(max_tokens=40, temperature=0, grammar=g),
                        loaded_rounded.eos_token_ids) for i, (p, g) in enumerate(zip(PROMPTS * 2, [JSON] * 8))]

    roomy = run_engine(make_engine(loaded_rounded, max_model_len=128), requests("r"))
    tight_engine = make_engine(loaded_rounded, max_model_len=128, num_kv_blocks=8)  # 128 tokens for 8 JSON answers
    tight = run_engine(tight_engine, requests("t"))
    assert tight_engine.stats()["num_preemptions"] > 0
    assert [tight[f"t{i}"] for i in range(8)] == [roomy[f"r{i}"] for i in range(8)]


@pytest.mark.parametrize("structured", [{"grammar": "start: <[49152]>"},  # a token id past the vocabulary
                                        {"choice": ["<|im_end|>"]}])  # a special token's text: llguidance cannot give it
async def test_a_grammar_the_vocabulary_cannot_follow_is_a_400_and_its_neighbour_answers_as_alone(server_fp32, structured):
    import asyncio

    from app.api.errors import to_api_error
    from app.api.protocol import CompletionRequest, parse_body

    plain = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    alone = await server_fp32.serving.completion(parse_body(plain, CompletionRequest))
    bad = server_fp32.serving.completion(parse_body({"prompt": "Say it:", "max_tokens": 4, "structured_outputs": structured},
                                                    CompletionRequest))
    failed, beside = await asyncio.gather(bad, server_fp32.serving.completion(parse_body(plain, CompletionRequest)),
                                          return_exceptions=True)
    error = to_api_error(failed)
    assert (error.status, error.code) == (400, "invalid_grammar"), error.message
    assert beside["choices"][0]["text"] == alone["choices"][0]["text"]


async def test_under_tool_choice_auto_a_format_holds_the_answer_and_each_call_its_tools_schema(server_fp32):
    """The Lark grammar of an answer in the format or Hermes calls (app/api/tools.py: answer_or_calls) through the real
    tokenizer and engine: whichever the model begins, the answer parses as the format's object, or the call as its
    tool's, and with parallel_tool_calls false the grammar ends after one call (greedy, the model calls here)."""
    import asyncio

    from app.api.protocol import ChatCompletionRequest, parse_body

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
    questions = ["What is the weather in Oslo? Call get_weather.", "Describe Paris as JSON."]
    bodies = [{"messages": [{"role": "user", "content": q}], "tools": [weather], "max_tokens": 60, "temperature": 0,
               "parallel_tool_calls": False,
               "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}}
              for q in questions]
    answers = await asyncio.gather(*(server_fp32.serving.chat(parse_body(b, ChatCompletionRequest)) for b in bodies))
    for answer in answers:
        choice = answer["choices"][0]
        calls = choice["message"].get("tool_calls")
        if calls:
            [call] = calls
            assert call["function"]["name"] == "get_weather" and len(json.loads(call["function"]["arguments"])["city"]) <= 20
            assert choice["finish_reason"] == "tool_calls"
        else:
            assert list(json.loads(choice["message"]["content"])) == ["city", "population_millions", "capital"], choice
    assert any(answer["choices"][0]["message"].get("tool_calls") for answer in answers)  # the format alone allows none


async def test_under_tool_choice_auto_a_strict_tools_call_follows_its_schema(server_fp32):
    """``strict: true`` under auto (app/api/tools.py: strict_calls) through the real tokenizer and engine: shown one
    call with a city alone, the model (greedy) calls again with a city alone, leaving out the unit the schema
    requires; with the tool strict, its call carries both, and the answer still ends as a call."""
    import asyncio

    from app.api.protocol import ChatCompletionRequest, parse_body

    def body(strict: bool) -> dict:
        weather = {"type": "function", "function": {"name": "get_weather", "strict": strict, "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}}
        shown = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        messages = [{"role": "user", "content": "What is the weather in Paris?"},
                    {"role": "assistant", "content": None, "tool_calls": [shown]},
                    {"role": "user", "content": "What is the weather in Oslo?"}]
        return {"messages": messages, "tools": [weather], "max_tokens": 60, "temperature": 0}

    free, strict = await asyncio.gather(*(server_fp32.serving.chat(parse_body(body(s), ChatCompletionRequest))
                                          for s in (False, True)))
    [free_call], [strict_call] = free["choices"][0]["message"]["tool_calls"], strict["choices"][0]["message"]["tool_calls"]
    assert json.loads(free_call["function"]["arguments"]) == {"city": "Oslo"}  # what the model writes on its own
    assert strict_call["function"]["name"] == "get_weather" and strict["choices"][0]["finish_reason"] == "tool_calls"
    arguments = json.loads(strict_call["function"]["arguments"])
    assert list(arguments) == ["city", "unit"] and arguments["city"] == "Oslo" and arguments["unit"] in ("celsius", "fahrenheit")


def test_a_draft_that_ends_a_grammar_with_eos_is_masked_without_rolling_back_what_was_never_kept(loaded_rounded):
    """A choice or regex grammar stops once complete; an n-gram draft completing it, then EOS (chat prompts are full of
    end tokens), then more: each position is masked as the grammar stands there, and the matcher is left as it was."""
    from app.engine.grammar import Grammars

    tokenizer, eos = loaded_rounded.tokenizer, sorted(loaded_rounded.eos_token_ids)[0]
    grammars = Grammars(tokenizer, len(tokenizer), frozenset(loaded_rounded.eos_token_ids))
    yes = tokenizer.encode("positive", add_special_tokens=False)
    for drafts in (yes + [eos], yes + [eos, 5], yes):
        request = Request("r", [1], SamplingParams(grammar=MOOD))
        request.matcher = grammars.matcher(MOOD)
        rows = torch.zeros(len(drafts) + 1, len(tokenizer))
        grammars.mask_drafts(rows, [request], [drafts])
        assert torch.isfinite(rows[len(yes)]).nonzero().squeeze(1).tolist() == [eos]  # complete: only EOS after it
        assert request.matcher.validate_tokens(yes) == len(yes)  # rolled back to where it stood


def test_an_ambiguous_grammar_fails_its_request_once_its_steps_pass_the_item_budget(loaded_rounded):
    """`s: s s | "a" | "b"` parses its output in ever more ways: unbounded, each step's mask took ~0.5 s by token 340,
    every batch-mate waiting. Past the step budget the request fails alone; an unambiguous grammar of the same
    language goes on."""
    from app.engine.grammar import GrammarError, Grammars

    tokenizer = loaded_rounded.tokenizer
    grammars = Grammars(tokenizer, len(tokenizer), frozenset(loaded_rounded.eos_token_ids))
    a, b = tokenizer.convert_tokens_to_ids("a"), tokenizer.convert_tokens_to_ids("b")

    def steps(grammar: str) -> int:
        request = Request("r", [1], SamplingParams(grammar=grammar))
        request.matcher = grammars.matcher(grammar)
        for step in range(400):
            grammars.mask(torch.zeros(1, len(tokenizer)), [request])  # raises for this request where it fails
            assert request.matcher.consume_token((a, b)[step % 2])
        return step + 1

    with pytest.raises(GrammarError, match="Too many items"):
        steps('start: s\ns: s s | "a" | "b"\n')
    assert steps('start: s\ns: ("a" | "b")+\n') == 400
    with pytest.raises(GrammarError, match="cannot be used"):  # a grammar that fails to compile fails again from the cache
        grammars.matcher("start: /(ab/")
    assert grammars._compiled.get("start: /(ab/") is not None
    with pytest.raises(GrammarError, match="cannot be used"):
        grammars.matcher("start: /(ab/")
