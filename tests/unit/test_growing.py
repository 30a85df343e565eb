"""Texts grown in place where they are held: the same text as ``+=`` gives, and a bad piece changes nothing."""

import pytest

from app.api.growing import grow_attribute, grow_item


class Holder:
    def __init__(self) -> None:
        self.text = "a"


def test_growing_gives_what_concatenation_gives_wherever_the_text_is_held():
    holder, items, keyed = Holder(), ["name", "{"], {"text": ""}
    pieces = ["b", "", "cd", "é", "\n" * 3, "x" * 1000]
    for piece in pieces:
        grow_attribute(holder, "text", piece)
        grow_item(items, 1, piece)
        grow_item(keyed, "text", piece)
    assert holder.text == "a" + "".join(pieces)
    assert items == ["name", "{" + "".join(pieces)] and keyed == {"text": "".join(pieces)}


def test_a_piece_that_is_no_text_leaves_the_text_where_it_was():
    holder, items = Holder(), ["name", "{"]
    with pytest.raises(TypeError):
        grow_attribute(holder, "text", None)
    with pytest.raises(TypeError):
        grow_item(items, 1, 5)
    assert holder.text == "a" and items == ["name", "{"]
