"""One chat reply read for tool calls (tool_parsers), in OpenAI's shapes: the whole reply's message
(`tool_calls`, `content` null when there is only calls) or a stream's deltas (each call's first
delta with its `index`, `id`, `type` and name, then pieces of `arguments`), and `finish_reason`
`tool_calls` when a reply that stopped by itself made calls. A request with the legacy `functions`
gets its call as `function_call` (finish reason `function_call`).
"""

from __future__ import annotations

import uuid

from serving.contracts.protocol import (
    ChatDelta,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from serving.engine.server.tool_parsers import Arguments, CallStart, Content, Family, ToolCallParser, parse
from serving.engine.server.tool_requests import ToolPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolReplies:
    def __init__(self, plan: ToolPlan, family: Family) -> None:
        self._plan = plan
        self._family = family
        self._stream = ToolCallParser(family, parallel=plan.parallel)

    def _finish(self, finish_reason: str | None, called: bool) -> str | None:
        if not called or finish_reason != "stop":
            return finish_reason
        return "function_call" if self._plan.legacy else "tool_calls"

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        """The whole reply's message and finish reason."""
        parsed = parse(self._family, text, parallel=self._plan.parallel)
        if not parsed.calls:
            return ChatResponseMessage(content=text), finish_reason
        calls = [ToolCall(id=call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))
                 for call in parsed.calls]
        if self._plan.legacy:
            message = ChatResponseMessage(content=parsed.content, function_call=calls[0].function)
        else:
            message = ChatResponseMessage(content=parsed.content, tool_calls=calls)
        return message, self._finish(finish_reason, called=True)

    def delta(self, text: str, finish_reason: str | None) -> tuple[ChatDelta, str | None]:
        """What a stream's next `text` adds (the reply's end when `finish_reason` is set)."""
        events = self._stream.feed(text)
        if finish_reason is not None:
            events += self._stream.finish()
        content = "".join(event.text for event in events if isinstance(event, Content))
        calls: dict[int, DeltaToolCall] = {}
        for event in events:
            if isinstance(event, CallStart):
                calls[event.index] = DeltaToolCall(index=event.index, id=call_id(), type="function",
                                                   function=DeltaFunctionCall(name=event.name, arguments=""))
            elif isinstance(event, Arguments):
                call = calls.setdefault(event.index, DeltaToolCall(index=event.index, function=DeltaFunctionCall()))
                call.function.arguments = (call.function.arguments or "") + event.text
        delta = ChatDelta(content=content or None)
        if self._plan.legacy:
            if 0 in calls:
                delta.function_call = calls[0].function
        elif calls:
            delta.tool_calls = [calls[index] for index in sorted(calls)]
        return delta, self._finish(finish_reason, called=self._stream.called and self._stream.valid)
