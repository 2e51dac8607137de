"""What a structured reply that `max_tokens` cut says about itself.

A reply held to a constraint (`response_format`, a `guided_*` field, `tool_choice` required or a
named function) can end only where its grammar is complete, so one the model ended matches. One
that `max_tokens` ended (finish_reason "length") is a prefix of a match, usually not a match itself:
JSON cut mid-value does not parse. The response keeps OpenAI's shape (the text as written,
finish_reason "length", as OpenAI's and vLLM's do) and adds `incomplete_details` to the choice
(`{"reason": "max_tokens", "param": <the constraint's field>, "message": …}`), so a caller that
trusted a strict schema finds out without parsing first (docs/tools-and-structured-output.md).
"""

from __future__ import annotations

from serving.contracts.protocol import IncompleteDetails, SamplingFields


def incomplete_details(body: SamplingFields, finish_reason: str | None) -> IncompleteDetails | None:
    """The marker for a choice of `body` that ended with `finish_reason` (None: not cut, or free text)."""
    if finish_reason != "length":
        return None
    constraints = body.constraints()
    if not constraints:
        return None
    param = constraints[0][0]
    return IncompleteDetails(param=param, message=(
        f"max_tokens (or the end of the model's context) ended this reply before the model completed the output "
        f"{param} asks for: the text is the cut-off beginning of a match, not necessarily a match (JSON cut this "
        "way does not parse). Send a larger max_tokens, or ask for shorter output."))
