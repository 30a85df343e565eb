"""suffix: the prompt and suffix around a model's FIM tokens, or a 400 where its vocabulary has none."""

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from app.api.errors import APIError
from app.api.fim import fim_prompt, fim_tokens


def _tokenizer(special: list[str]) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "def": 1, "f": 2, "return": 3}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")), unk_token="[UNK]")
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


@pytest.mark.parametrize("family", [["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
                                    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]])
def test_a_model_with_fim_tokens_gets_prefix_suffix_middle(family):
    tokenizer = _tokenizer(family)
    assert fim_tokens(tokenizer) == tuple(family)
    text = fim_prompt(tokenizer, "def f(x):\n", "\n    return y", "coder")
    assert text == f"{family[0]}def f(x):\n{family[1]}\n    return y{family[2]}"
    ids = tokenizer.encode(text)
    assert [tokenizer.convert_tokens_to_ids(t) for t in family] == [i for i in ids if tokenizer.convert_ids_to_tokens(i) in family]


def test_a_model_without_fim_tokens_refuses_suffix_by_name():
    with pytest.raises(APIError) as caught:
        fim_prompt(_tokenizer(["<fim_prefix>"]), "def f():", "return 1", "chatty")  # one of three is not a FIM format
    assert caught.value.status == 400 and caught.value.param == "suffix" and "no fill-in-the-middle" in caught.value.message


def test_echo_with_a_suffix_is_a_400_naming_echo():
    """The model reads the FIM layout: the echoed prompt text and the prompt logprobs would not match each other."""
    from app.api.protocol import CompletionRequest, parse_body

    with pytest.raises(APIError, match="echo cannot be combined with suffix") as refused:
        parse_body({"model": "m", "prompt": "def f(", "suffix": "\n  return x", "echo": True, "logprobs": 1}, CompletionRequest)
    assert refused.value.param == "echo"
    # an empty suffix is none (the prompt is used as it is): echo beside it is taken
    assert parse_body({"model": "m", "prompt": "def f(", "suffix": "", "echo": True}, CompletionRequest).echo
