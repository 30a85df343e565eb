"""The base of every request body: parsed strictly (an unknown field, or a value of the wrong JSON type, is an error),
an explicit null taken as unset where the field has no null of its own."""

from __future__ import annotations

import typing
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, model_validator


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """An explicit null takes the field's default where the field has no null of its own, as OpenAI's
        nullable fields do (clients send ``"n": null`` for an unset option); a field that takes null (``max_tokens``:
        as long as the context allows) or must be given sees the null itself."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required() or _takes_null(fields[key])}


def _takes_null(field: pydantic.fields.FieldInfo) -> bool:
    return field.annotation is Any or type(None) in typing.get_args(field.annotation)
