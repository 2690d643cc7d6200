"""The base of every config and manifest struct, and the constrained numbers they share."""

from __future__ import annotations

from typing import Annotated

import msgspec

Positive = Annotated[int, msgspec.Meta(ge=1)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class Struct(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=False):
    """Base of every config and manifest struct: strict (unknown fields are errors), keyword-only."""
