from app.engine.detokenizer import IncrementalDetokenizer


class CharTokenizer:
    """Token i is chr(i); enough to test offsets, stop strings and hold-back."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def _feed(text, stop=()):
    detok = IncrementalDetokenizer(CharTokenizer(), [ord("p")], stop=stop)
    pieces, stopped = [], False
    for ch in text:
        piece, stopped = detok.add_token(ord(ch))
        pieces.append(piece)
        if stopped:
            break
    if not stopped:
        pieces.append(detok.flush())
    return "".join(pieces), stopped, pieces


def test_streams_all_text_without_stop():
    text, stopped, _ = _feed("hello world")
    assert text == "hello world" and not stopped


def test_stop_string_is_cut_and_never_streamed():
    text, stopped, pieces = _feed("abc STOP def", stop=("STOP",))
    assert text == "abc " and stopped
    assert "S" not in "".join(pieces)
