"""The scheduler without a model: hand-built runner results drive it step by step."""

import pytest
from app.engine.kv_cache import BlockManager
from app.engine.request import Request, RequestStatus, SamplingParams
from app.engine.scheduler import Scheduler, SchedulerConfig


def _request(rid: str, prompt_len: int, max_tokens: int = 4, group: int = 0, first_token: int = 100) -> Request:
    """Prompts share their first tokens unless ``first_token`` differs (prefix caching matters)."""
    request = Request(rid, list(range(first_token, first_token + prompt_len)), SamplingParams(max_tokens=max_tokens))
    request.group = group
    return request


def _scheduler(num_blocks=64, block_size=4, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


def _step(scheduler: Scheduler) -> dict[str, int]:
    """One step with a fake runner: every request that reaches its last token samples token 7."""
    output = scheduler.schedule()
    sampling = [s.request for s in output.scheduled if s.samples]
    scheduler.update(output)
    for request in sampling:
        request.output_token_ids.append(7)
        if request.num_output_tokens >= request.sampling.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            scheduler.remove_request(request.request_id)
    return {s.request.request_id: s.num_new_tokens for s in output.scheduled}


def test_token_budget_chunks_a_long_prefill():
    scheduler = _scheduler(max_num_batched_tokens=8)
    scheduler.add_request(_request("long", 20))
    assert [_step(scheduler) for _ in range(3)] == [{"long": 8}, {"long": 8}, {"long": 4}]
    assert scheduler.running[0].num_output_tokens == 1


def test_decodes_go_first_and_prefills_fill_the_rest():
    scheduler = _scheduler(max_num_batched_tokens=10)
    scheduler.add_request(_request("a", 3))
    _step(scheduler)  # a prefilled, now decoding
    scheduler.add_request(_request("b", 30))
    assert _step(scheduler) == {"a": 1, "b": 9}


def test_max_num_seqs_caps_the_running_batch():
    scheduler = _scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", 3))
    assert set(_step(scheduler)) == {"r0", "r1"}
    assert [r.request_id for r in scheduler.waiting] == ["r2"]


def test_new_requests_join_a_running_batch_in_continuous_mode():
    scheduler = _scheduler()
    scheduler.add_request(_request("first", 3, max_tokens=10))
    _step(scheduler)
    scheduler.add_request(_request("late", 3))
    assert _step(scheduler) == {"first": 1, "late": 3}


def test_gang_mode_runs_a_group_to_completion_before_the_next():
    scheduler = _scheduler(gang=True)
    scheduler.add_request(_request("g0-a", 3, max_tokens=3, group=0))
    scheduler.add_request(_request("g0-b", 3, max_tokens=1, group=0))
    scheduler.add_request(_request("g1-a", 3, max_tokens=1, group=1))
    assert set(_step(scheduler)) == {"g0-a", "g0-b"}
    assert _step(scheduler) == {"g0-a": 1}  # g0-b finished, but group 1 may not start yet
    assert _step(scheduler) == {"g0-a": 1}
    assert _step(scheduler) == {"g1-a": 3}


def test_running_out_of_blocks_preempts_the_newest_and_recomputes_it_later():
    scheduler = _scheduler(num_blocks=4, block_size=4)  # 16 token slots
    old, new = _request("old", 6, max_tokens=8), _request("new", 6, max_tokens=8, first_token=500)
    scheduler.add_request(old)
    scheduler.add_request(new)
    for _ in range(3):  # prefill (6 tokens), then decodes of tokens 7 and 8: two blocks each, pool full
        _step(scheduler)
    _step(scheduler)  # old needs a third block for its 9th token: new is preempted
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1 and scheduler.waiting[0] is new
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert old.num_output_tokens == 8 and new.num_output_tokens == 8
    assert scheduler.blocks.num_free_blocks == 4
    # the hit rate is the cache's on new requests (vLLM's): a resumed preemption's lookup is not counted again
    assert scheduler.blocks.prefix_stats.queried_tokens == 6 + 6


def test_a_waiting_request_waits_for_blocks_instead_of_failing():
    scheduler = _scheduler(num_blocks=3, block_size=4)
    scheduler.add_request(_request("big", 10, max_tokens=2))
    scheduler.add_request(_request("next", 6, max_tokens=1, first_token=500))
    assert _step(scheduler) == {"big": 10}  # 3 blocks used; "next" cannot fit yet
    assert _step(scheduler) == {"big": 1}
    assert _step(scheduler) == {"next": 6}


@pytest.mark.parametrize("first_salt, second_salt, hit", [("t1", "t1", 8), ("t1", "t2", 0), ("t1", None, 0), (None, None, 8)])
def test_a_request_hits_the_prefix_cache_only_behind_a_prompt_of_its_own_salt(first_salt, second_salt, hit):
    scheduler = _scheduler(block_size=4)
    a = _request("a", 10, max_tokens=1)
    a.cache_salt = first_salt
    scheduler.add_request(a)
    _step(scheduler)
    b = _request("b", 10, max_tokens=1)
    b.cache_salt = second_salt
    scheduler.add_request(b)
    assert _step(scheduler) == {"b": 10 - hit} and b.num_cached_tokens == hit


def test_removing_a_request_frees_its_blocks_at_once():
    scheduler = _scheduler(num_blocks=8)
    scheduler.add_request(_request("a", 9))
    _step(scheduler)
    assert scheduler.blocks.num_used_blocks == 3
    assert scheduler.remove_request("a").request_id == "a"
    assert scheduler.blocks.num_free_blocks == 8 and not scheduler.has_unfinished_requests()
    assert scheduler.remove_request("a") is None


def test_prefix_hit_skips_cached_tokens():
    scheduler = _scheduler(block_size=4)
    scheduler.add_request(_request("a", 10, max_tokens=1))
    _step(scheduler)
    b = _request("b", 10, max_tokens=1)
    scheduler.add_request(b)
    assert _step(scheduler) == {"b": 2}  # 8 of its 10 prompt tokens were in the cache
    assert b.num_cached_tokens == 8
    stats = scheduler.blocks.prefix_stats
    assert (stats.queried_tokens, stats.hit_tokens) == (20, 8)


def test_requests_arriving_together_compute_their_shared_prompt_once():
    """n choices of one prompt arrive at once: the first computes the prompt; the others wait one step and find
    it in the cache (a block is cached only once computed); a request sharing nothing is admitted beside it."""
    scheduler = _scheduler(block_size=4)
    for rid in ("c0", "c1", "c2"):
        scheduler.add_request(_request(rid, 10, max_tokens=2))
    scheduler.add_request(_request("other", 6, max_tokens=2, first_token=500))
    assert _step(scheduler) == {"c0": 10, "other": 6}
    assert _step(scheduler) == {"c0": 1, "other": 1, "c1": 2, "c2": 2}  # 8 of 10 from the cache
    stats = scheduler.blocks.prefix_stats
    assert (stats.queried_tokens, stats.hit_tokens) == (36, 16)
    while scheduler.has_unfinished_requests():
        _step(scheduler)
    assert scheduler.blocks.num_free_blocks == 64


def test_a_shared_prompt_prefilled_in_chunks_is_waited_for_chunk_by_chunk():
    scheduler = _scheduler(block_size=4, max_num_batched_tokens=8)
    scheduler.add_request(_request("first", 20, max_tokens=1))
    scheduler.add_request(_request("twin", 20, max_tokens=1))
    # twin waits while its next block is being computed; its last block (never looked up: the last token always
    # runs) it computes itself, beside first's
    assert [_step(scheduler) for _ in range(3)] == [{"first": 8}, {"first": 8}, {"first": 4, "twin": 4}]
    assert scheduler.blocks.prefix_stats.hit_tokens == 16


def test_prompt_logprobs_take_no_cached_prefix_so_nothing_waits_for_one():
    scheduler = _scheduler(block_size=4)
    scheduler.add_request(_request("a", 10, max_tokens=1))
    scored = _request("scored", 10, max_tokens=1)
    scored.sampling = SamplingParams(max_tokens=1, prompt_logprobs=0)
    scheduler.add_request(scored)
    assert _step(scheduler) == {"a": 10, "scored": 10}
    stats = scheduler.blocks.prefix_stats  # the scored prompt looked nothing up: it is no query of the cache
    assert (stats.queried_tokens, stats.hit_tokens) == (10, 0)


def test_with_prefix_caching_off_no_lookup_is_counted():
    scheduler = Scheduler(SchedulerConfig(), BlockManager(64, 4, enable_prefix_caching=False))
    scheduler.add_request(_request("a", 10, max_tokens=1))
    _step(scheduler)
    assert (scheduler.blocks.prefix_stats.queried_tokens, scheduler.blocks.prefix_stats.hit_tokens) == (0, 0)


def _step_capped(scheduler: Scheduler, cap: int, step_seconds=None) -> dict[str, int]:
    output = scheduler.schedule(decode_step_tokens=cap, step_seconds=step_seconds)
    sampling = [s.request for s in output.scheduled if s.samples]
    scheduler.update(output)
    for request in sampling:
        request.output_token_ids.append(7)
        request.first_token_s = request.first_token_s or 1.0  # as the engine's output processor records it
    return {s.request.request_id: s.num_new_tokens for s in output.scheduled}


def test_beside_decodes_a_long_prompt_gets_only_what_the_step_cap_leaves():
    scheduler = _scheduler(num_blocks=128, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(_request(f"d{i}", 4, max_tokens=50, first_token=10 * i))
    assert _step_capped(scheduler, cap=16) == {"d0": 4, "d1": 4, "d2": 4}  # no decodes yet: prefills fill the budget
    scheduler.add_request(_request("long", 200, first_token=500))
    assert _step_capped(scheduler, cap=16) == {"d0": 1, "d1": 1, "d2": 1, "long": 13}  # 16 tokens, decodes first
    assert _step_capped(scheduler, cap=2) == {"d0": 1, "d1": 1, "d2": 1, "long": 4}  # at least one block beside them
    alone = _scheduler(num_blocks=128, max_num_batched_tokens=64)
    alone.add_request(_request("long", 200, first_token=500))
    assert _step_capped(alone, cap=16) == {"long": 64}  # nothing decodes: the whole budget


def test_with_nothing_decoding_several_prompts_keep_the_cap_so_first_tokens_come_sooner():
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=64)
    for i in range(4):  # 40 prompt tokens: one whole step gives all four first tokens at its end
        scheduler.add_request(_request(f"p{i}", 10, max_tokens=50, first_token=100 * (i + 1)))
    assert _step_capped(scheduler, cap=16) == {"p0": 10, "p1": 6}
    assert _step_capped(scheduler, cap=16) == {"p0": 1, "p1": 4, "p2": 10, "p3": 1}  # p0 decodes: the cap as before


def test_with_nothing_decoding_a_long_first_prompt_or_a_long_burst_takes_the_whole_budget():
    long_first = _scheduler(num_blocks=256, max_num_batched_tokens=64)
    long_first.add_request(_request("long", 40, first_token=100))
    long_first.add_request(_request("short", 4, first_token=200))
    assert _step_capped(long_first, cap=16) == {"long": 40, "short": 4}  # chunks would only delay the first
    burst = _scheduler(num_blocks=256, max_num_batched_tokens=64)
    for i in range(21):  # 63 prompt tokens: more than 15 bounded steps of 4
        burst.add_request(_request(f"p{i}", 3, first_token=10 * (i + 1)))
    assert _step_capped(burst, cap=4) == {f"p{i}": 3 for i in range(21)}


def test_a_burst_waiting_for_first_tokens_outnumbering_the_streams_takes_the_whole_budget():
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=128, max_num_seqs=6)
    scheduler.add_request(_request("early", 4, max_tokens=50, first_token=0))
    assert _step_capped(scheduler, cap=16) == {"early": 4}
    for i in range(8):  # more than the free sequence slots: only 5 of them can be prefilled now
        scheduler.add_request(_request(f"burst{i}", 14, first_token=100 * (i + 1)))
    # one stream against five first tokens, 70 prompt tokens: 17.5 steps at the cap's 4 beside the stream, one at 128
    assert _step_capped(scheduler, cap=5) == {"early": 1, **{f"burst{i}": 14 for i in range(5)}}
    # six streams now, three still waiting (no slot for them): decodes alone, within the cap
    assert _step_capped(scheduler, cap=5) == {"early": 1, **{f"burst{i}": 1 for i in range(5)}}


def test_a_burst_of_a_few_bounded_steps_keeps_the_cap():
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=64)
    scheduler.add_request(_request("early", 4, max_tokens=50, first_token=0))
    _step_capped(scheduler, cap=16)
    for i in range(5):  # 50 prompt tokens: under 4 steps at the cap's 15 beside the stream
        scheduler.add_request(_request(f"burst{i}", 10, first_token=100 * (i + 1)))
    assert _step_capped(scheduler, cap=16) == {"early": 1, "burst0": 10, "burst1": 5}


def test_a_burst_longer_than_one_full_step_leaves_the_stream_its_cap():
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=64)
    scheduler.add_request(_request("early", 4, max_tokens=50, first_token=0))
    _step_capped(scheduler, cap=16)
    for i in range(2):  # two first tokens against one stream, but 80 prompt tokens: more than one step's 64
        scheduler.add_request(_request(f"long{i}", 40, first_token=100 * (i + 1)))
    assert _step_capped(scheduler, cap=5) == {"early": 1, "long0": 4}


def test_a_preempted_request_had_its_first_token_and_takes_its_slot_first():
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=256, max_num_seqs=3)
    scheduler.add_request(_request("early", 4, max_tokens=50, first_token=0))
    _step_capped(scheduler, cap=16)
    resumed = _request("resumed", 4, max_tokens=50, first_token=50)
    resumed.output_token_ids.append(7)
    resumed.first_token_s, resumed.status = 1.0, RequestStatus.PREEMPTED
    scheduler.waiting.append(resumed)  # back from a preemption: its stream waits, its first token is out
    for i in range(3):
        scheduler.add_request(_request(f"new{i}", 60, first_token=100 * (i + 1)))
    # two free slots, the resumed request's first: one first token against one stream, so the cap holds
    assert _step_capped(scheduler, cap=5) == {"early": 1, "resumed": 4}


def test_streams_that_outnumber_the_first_tokens_keep_the_cap():
    scheduler = _scheduler(num_blocks=256, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(_request(f"d{i}", 4, max_tokens=50, first_token=10 * i))
    _step_capped(scheduler, cap=16)
    for i in range(3):  # as many waiting as decoding: the streams keep their bound
        scheduler.add_request(_request(f"new{i}", 20, first_token=100 * (i + 1)))
    assert _step_capped(scheduler, cap=16) == {"d0": 1, "d1": 1, "d2": 1, "new0": 13}
    # new0 is still prefilling: with new1 and new2 waiting, three first tokens against three streams
    assert _step_capped(scheduler, cap=16) == {"d0": 1, "d1": 1, "d2": 1, "new0": 7, "new1": 6}


def test_the_step_cost_learns_the_per_token_cost_from_the_first_step():
    from app.engine.step_budget import StepCost

    cost = StepCost()
    assert cost.tokens_within(0.2) is None  # nothing measured: no cap
    cost.observe(2048, 2.048)  # the warm-up's full step: 1 ms a token
    assert cost.tokens_within(0.2) == pytest.approx(200, abs=1)


def test_a_step_cost_model_with_fixed_and_per_key_terms_fits_what_the_steps_took():
    from app.engine.step_budget import StepCost

    cost = StepCost()
    fixed, per_token, per_key = 0.03, 1e-3, 1e-6  # the machine: 30 ms a step, 1 ms a token, 1 us an attended key

    def step(tokens: int, keys: float) -> None:
        cost.observe(tokens, fixed + tokens * per_token + keys * per_key, keys)

    step(2048, 2048 * 1024)  # the warm-up
    for context in range(100, 400, 20):  # 8 streams decoding
        step(8, 8 * context)
    for offset in (0, 200, 400, 600, 800):  # beside them, a long prompt's chunks of 200 tokens, each deeper
        step(208, 8 * 500 + 200 * (offset + 100.5))
    a, b, c = cost.coefficients()
    assert (a, b, c) == (pytest.approx(fixed), pytest.approx(per_token), pytest.approx(per_key))
    assert cost.tokens_within(0.2, keys_per_token=0) == pytest.approx(170, abs=1)
    assert cost.tokens_within(0.2, keys_per_token=1500) == pytest.approx(68, abs=1)  # 2.5 ms a token that deep
    assert cost.tokens_within(0.02) == 0  # less than a step's fixed cost: nothing (the scheduler's floor applies)


def test_until_the_steps_differ_enough_the_model_keeps_fewer_terms():
    from app.engine.step_budget import StepCost

    cost = StepCost()
    for _ in range(3):
        cost.observe(100, 0.1, keys=100 * 50)  # always alike: neither a fixed nor a per-key cost can be told apart
    assert cost.coefficients() == (0.0, pytest.approx(1e-3), 0.0)


def test_drafts_take_only_what_is_left_after_every_running_request_has_its_token():
    scheduler = _scheduler(max_num_batched_tokens=4)
    for i in range(3):
        scheduler.add_request(_request(f"r{i}", 1, max_tokens=20, first_token=100 + 10 * i))
    _step(scheduler)  # all three prefilled (one token each), now decoding
    scheduler.running[0].set_drafts([7, 7, 7, 7])
    output = scheduler.schedule()
    assert {s.request.request_id: (s.num_new_tokens, s.num_spec_tokens) for s in output.scheduled} == {
        "r0": (2, 1), "r1": (1, 0), "r2": (1, 0)}  # before: r0 took 1 + 3 drafts, r1 and r2 nothing


def test_drafts_never_preempt_a_request():
    scheduler = _scheduler(num_blocks=2, block_size=4)  # 8 token slots
    old, new = _request("old", 3, max_tokens=20), _request("new", 3, max_tokens=20, first_token=500)
    scheduler.add_request(old)
    scheduler.add_request(new)
    _step(scheduler)  # both prefilled: one block each, each with room for one more token
    old.set_drafts([7, 7, 7])  # would need a second block, which only preempting "new" could free
    output = scheduler.schedule()
    assert not output.preempted and new.status is RequestStatus.RUNNING
    assert {s.request.request_id: (s.num_new_tokens, s.num_spec_tokens) for s in output.scheduled} == {
        "old": (1, 0), "new": (1, 0)}


def test_a_bound_is_planned_with_headroom_and_for_the_deepest_prompts_next_chunk():
    from app.engine.step_budget import StepCost

    cost = StepCost()
    assert cost.tokens_within_bound(0.2, prefill_offset=0) is None  # nothing measured: no cap
    fixed, per_token, per_key = 0.03, 1e-3, 1e-6
    cost.observe(2048, fixed + 2048 * per_token + 2048 * 1024 * per_key, 2048 * 1024)
    for tokens, keys in ((8, 8 * 300), (208, 8 * 500 + 200 * 300), (108, 8 * 600 + 100 * 900), (16, 16 * 200)):
        cost.observe(tokens, fixed + tokens * per_token + keys * per_key, keys)
    fresh = cost.tokens_within_bound(0.2, prefill_offset=0)
    # planned to 90% of 200 ms (180 ms): 150 ms over ~1.0 ms a token plus its keys; to the whole bound it would be ~170
    assert fresh == pytest.approx(int(0.15 / (per_token + per_key * fresh / 2)), abs=2)
    assert fresh < cost.tokens_within(0.2)
    deep = cost.tokens_within_bound(0.2, prefill_offset=1500)  # a chunk 1,500 tokens in pays for the keys behind it
    assert deep == pytest.approx(int(0.15 / (per_token + per_key * (1500 + deep / 2))), abs=2)
    assert deep < fresh


def test_a_token_cap_bounds_every_step_below_the_budget():
    """After a step ran out of memory the engine caps steps below max_num_batched_tokens: prompts go in smaller
    chunks, and a burst that fits the budget but not the cap waits its turn."""
    def scheduler():
        made = _scheduler(max_num_batched_tokens=32)
        made.add_request(_request("a", 20))
        made.add_request(_request("b", 20, first_token=300))
        return made

    output = scheduler().schedule(token_cap=8)
    assert {s.request.request_id: s.num_new_tokens for s in output.scheduled} == {"a": 8}
    output = scheduler().schedule(token_cap=64)  # a cap above the budget: the budget bounds the step
    assert {s.request.request_id: s.num_new_tokens for s in output.scheduled} == {"a": 20, "b": 12}


def test_the_step_token_cap_halves_on_out_of_memory_and_doubles_back_after_steps_that_fit():
    from app.engine.step_budget import StepTokenCap

    cap = StepTokenCap(limit=2048)
    assert cap.cap is None and cap.tokens == 2048
    cap.shrink(1500)  # a 1,500-token step ran out of memory
    assert cap.cap == 750
    cap.shrink(2000)  # a larger failure never raises it
    assert cap.cap == 750
    cap.shrink(1)
    assert cap.cap == 1  # a step always carries a token
    cap.shrink(1500)
    for _ in range(StepTokenCap.REGROW_STEPS - 1):
        cap.fitted()
    assert cap.cap == 1
    cap.fitted()
    assert cap.cap == 2
    for _ in range(StepTokenCap.REGROW_STEPS * 11):
        cap.fitted()
    assert cap.cap is None and cap.tokens == 2048  # lifted once doubling reaches the budget
