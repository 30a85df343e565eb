"""A draft replica's answer when the draft request itself fails in its engine (a request the draft model cannot go
on with: its bans, its format): the tokens drafted so far and no error, so the target's drafter keeps drafting for its
other sequences (an error reads as the replica failing, and pauses drafting for all of them)."""

from app.config import AppConfig
from app.engine.request import SamplingParams
from app.spec.remote import DraftCall
from tests.serve import fake_model


async def test_a_draft_request_failing_in_the_engine_answers_what_it_drafted_without_an_error(quick_fake_steps):
    served = {"model": {"source": "fake-draft"}, "engine": {"separate_process": False}}
    server = fake_model.fake_model_server(AppConfig.from_dict({"models": [served]}).models[0])
    try:
        prompt = list(b"please fail-after-2 here")
        result = await server.propose(DraftCall(1, 0, "seq-1", prompt, [], 4, SamplingParams(temperature=0)))
        assert result.error is None and result.token_ids == prompt[:2]  # the echo's two tokens before it failed
        plain = await server.propose(DraftCall(2, 0, "seq-2", list(b"fine"), [], 3, SamplingParams(temperature=0)))
        assert plain.error is None and plain.token_ids == list(b"fin")
    finally:
        server.shutdown(timeout_s=1)
