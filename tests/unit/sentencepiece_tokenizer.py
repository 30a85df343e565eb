"""Llama-style sentencepiece tokenizers built offline in a few milliseconds: BPE with byte fallback over a tiny
corpus, the word-initial "▁" that decoding strips from a text's first token, special and added tokens. ``legacy``:
Llama 1/2's layout (the space marker from the normalizer); otherwise Metaspace's (Mistral, Llama 2 non-legacy)."""

import json

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = ["Hello world, this is a test.", "The answer is 42.", "hello there friend", "Is it? Yes! No, maybe."] * 20


def sentencepiece_tokenizer(legacy: bool = True, corpus: list[str] = CORPUS) -> PreTrainedTokenizerFast:
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trained.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                                            show_progress=False))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for token, _ in sorted(trained.get_vocab().items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in json.loads(trained.to_str())["model"]["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if legacy:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True),
                                  AddedToken("<|sp|>", special=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   legacy=legacy)
