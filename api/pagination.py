"""The one list shape of every API: `{"object": "list", "data", "has_more", "first_id", "last_id"}`.

Lists are paged with a cursor, as OpenAI's are: `?limit=` rows (1–100, default 20) that come after
the row named by `?after=` (the `last_id` of the previous page) in the list's own order. A cursor
names a row by the same id the rows carry (`id`, an adapter's `name`, a version's `version`), so a
client walks any list the same way, and a row deleted meanwhile never makes a page skip or repeat.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from drf_spectacular.drainage import set_override
from drf_spectacular.utils import OpenApiParameter, inline_serializer
from rest_framework import serializers
from rest_framework.request import Request

from serving.contracts.errors import InvalidInput

DEFAULT_LIMIT = 20
MAX_LIMIT = 100

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class _Sliceable(Protocol[T_co]):
    """What `take` reads: a list, or a queryset (which turns the slice into a LIMIT)."""

    def __getitem__(self, index: slice, /) -> Iterable[T_co]: ...


@dataclass(frozen=True)
class PageRequest:
    limit: int
    # The cursor as given; each list decides what it names (see int_after for numeric ids).
    after: str | None

    def int_after(self, prefix: str = "") -> int | None:
        """The cursor as a numeric id (`prefix` stripped, e.g. "file-"); InvalidInput when it is not one."""
        if self.after is None:
            return None
        text = self.after.removeprefix(prefix)
        if not self.after.startswith(prefix) or not text.isdigit() or len(text) > 18:
            expected = f"an id like '{prefix}123'" if prefix else "an integer id"
            raise InvalidInput(f"'after' must be {expected} (the last_id of the previous page), got "
                               f"{self.after!r}.", code="invalid_cursor", param="after")
        return int(text)


def page_request(request: Request) -> PageRequest:
    """`limit` and `after` of a list request; InvalidInput naming the bad one."""
    raw_limit = request.query_params.get("limit")
    if raw_limit in (None, ""):
        limit = DEFAULT_LIMIT
    else:
        try:
            limit = int(raw_limit)
        except ValueError:
            raise InvalidInput(f"'limit' must be an integer from 1 to {MAX_LIMIT}, got {raw_limit!r}.",
                               code="invalid_limit", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise InvalidInput(f"'limit' must be from 1 to {MAX_LIMIT}, got {limit}.", code="invalid_limit",
                           param="limit")
    after = request.query_params.get("after")
    return PageRequest(limit=limit, after=after if after not in (None, "") else None)


def take(rows: _Sliceable[T], limit: int) -> tuple[list[T], bool]:
    """The first `limit` of `rows` (a queryset or a list, already ordered and past the cursor) and
    whether more follow; a queryset is read with one LIMIT query."""
    got = list(rows[: limit + 1])
    return got[:limit], len(got) > limit


def list_body(data: Sequence[dict[str, Any]], *, has_more: bool, id_key: str = "id") -> dict[str, Any]:
    """The list object around one page of serialized rows."""
    return {
        "object": "list",
        "data": list(data),
        "has_more": has_more,
        "first_id": data[0][id_key] if data else None,
        "last_id": data[-1][id_key] if data else None,
    }


def paging_parameters(cursor: str = "the id") -> list[OpenApiParameter]:
    """The `limit` and `after` query parameters, for a list's schema."""
    return [
        OpenApiParameter("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT},
                         description=f"Rows per page (1–{MAX_LIMIT}, default {DEFAULT_LIMIT})."),
        OpenApiParameter("after", str, description=f"Return the rows after this one: {cursor} of the last row of "
                                                   "the previous page (its `last_id`)."),
    ]


def list_schema(serializer: type[serializers.Serializer], name: str,
                id_type: type[serializers.Field] = serializers.CharField) -> serializers.Serializer:
    """The schema of a list of `serializer` rows whose ids are of `id_type`: the list object itself,
    never an array of them (drf-spectacular wraps a `list` action's response in an array unless told
    `many=False`)."""
    envelope = inline_serializer(name, {"object": serializers.ChoiceField(choices=["list"]),
                                        "data": serializer(many=True), "has_more": serializers.BooleanField(),
                                        "first_id": id_type(allow_null=True), "last_id": id_type(allow_null=True)})
    set_override(envelope, "many", False)
    return envelope
