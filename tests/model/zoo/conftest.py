"""The zoo's shared pieces: one folder of tiny checkpoints per session, built once, and the embedded tokenizer."""

from __future__ import annotations

import pathlib

import pytest


@pytest.fixture(scope="session")
def zoo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("zoo")


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from app.models.registry import prepare_builtin

    return AutoTokenizer.from_pretrained(prepare_builtin("smollm2-135m-instruct"))


@pytest.fixture(autouse=True)
def one_tokenizer_load(tokenizer, zoo_dir, monkeypatch):
    """Every zoo checkpoint holds the embedded model's tokenizer: the loader gets the one loaded above instead of
    reading it again for each of the ~45 loads (~0.2 s each)."""
    from transformers import AutoTokenizer

    load = AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, path, *args, **kwargs):
        return tokenizer if pathlib.Path(path).parent == zoo_dir else load(cls, path, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(from_pretrained))
