"""Which default a field a request leaves unset takes: the config's default_sampling, then the checkpoint's
generation_config, then OpenAI's."""

import logging

from app.api.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from app.config import ModelConfig, ServedModelConfig
from app.engine.core_process import CoreInfo
from app.server import _sampling_defaults


def test_the_config_wins_over_the_checkpoint_and_the_checkpoint_over_openai(caplog):
    info = CoreInfo("m", None, 64, frozenset(), 32, 0.0, {"temperature": 0.7, "top_k": 20})
    config = ServedModelConfig(model=ModelConfig(name="m"), default_sampling={"temperature": 0.2})
    with caplog.at_level(logging.INFO, logger="app.server"):
        defaults = _sampling_defaults(info, config)
    assert defaults == {"temperature": 0.2, "top_k": 20}
    assert "take its generation_config's top_k=20" in caplog.text  # the one it applies, said once at start
    request = parse_body({"messages": [{"role": "user", "content": "hi"}], "top_p": 0.5}, ChatCompletionRequest)
    sampling = request.sampling_params(8, defaults)
    assert (sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p) == (0.2, 20, 0.5, 0.0)


async def test_a_default_max_tokens_bounds_an_answer_that_leaves_it_unset_and_a_request_may_ask_for_more():
    from app.config import AppConfig
    from tests.serve import fake_model
    from tests.serve.fake_model import REPLAY

    served = {"model": {"source": "fake-tools"}, "engine": {"separate_process": False}, "default_sampling": {"max_tokens": 3}}
    server = fake_model.fake_model_server(AppConfig.from_dict({"models": [served]}).models[0])
    try:
        chat = {"messages": [{"role": "user", "content": f"{REPLAY[0].decode()}It is sunny today.{REPLAY[1].decode()}"}]}
        unset = await server.serving.chat(parse_body(chat, ChatCompletionRequest))
        asked = await server.serving.chat(parse_body({**chat, "max_tokens": 5}, ChatCompletionRequest))
        assert [(a["usage"]["completion_tokens"], a["choices"][0]["finish_reason"]) for a in (unset, asked)] == \
               [(3, "length"), (5, "length")]
        # a completion's max_tokens: null asks for what the context leaves (its unset is OpenAI's 16): not chat's default
        text = {"prompt": f"{REPLAY[0].decode()}It is sunny today.{REPLAY[1].decode()}"}
        null = await server.serving.completion(parse_body({**text, "max_tokens": None}, CompletionRequest))
        assert null["usage"]["completion_tokens"] > 3 and null["choices"][0]["finish_reason"] == "stop"
    finally:
        server.shutdown(timeout_s=1)
