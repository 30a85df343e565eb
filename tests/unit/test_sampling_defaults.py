"""Which default a field a request leaves unset takes: the config's default_sampling, then the checkpoint's
generation_config, then OpenAI's."""

import logging

from app.api.protocol import ChatCompletionRequest, parse_body
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
