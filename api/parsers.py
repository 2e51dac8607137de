"""The API's JSON parser: DRF's, with the gateway's bounds on a body (serving.contracts.request_caps).

DRF's JSONParser hands the body to Python's decoder, which recurses: a 100,000-deep body raised
RecursionError, which DRF does not turn into a parse error, so the management API and the OpenAI
training routes answered 500 (issue 37, item 8). request_caps.loads measures the nesting first,
without recursion, against the gateway's and the worker's MAX_JSON_DEPTH (one bound on every JSON
surface), and refuses NaN and Infinity, which JSON does not have; either is a 400 naming what it
found. Every DRF view takes JSON through this class (DEFAULT_PARSER_CLASSES and the views that name
their parsers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import ParseError

from serving.contracts import request_caps
from serving.contracts.errors import InvalidInput


class JSONParser(parsers.JSONParser):
    def parse(self, stream: IO[Any], media_type: str | None = None,
              parser_context: Mapping[str, Any] | None = None) -> Any:
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            return request_caps.loads(stream.read().decode(encoding))
        except request_caps.CapExceeded as error:
            raise InvalidInput(error.message, code=error.code, param=error.param) from None
        except ValueError as error:  # not JSON, or not in the request's charset (UnicodeDecodeError)
            raise ParseError(f"JSON parse error - {error}") from None
