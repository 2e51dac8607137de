"""Gateway usage records made as the gateway's flusher writes them, for the dashboard's tests."""

from __future__ import annotations

import uuid
from datetime import timedelta

from django.utils import timezone


def record(tenant, *, adapter: str = "", version: str = "", key: str = "abc", latency: float = 100.0,
           status: str = "ok", prompt: int = 10, completion: int = 5, ago: timedelta = timedelta(0)):
    """One gateway usage record, as the gateway's flusher writes it."""
    from serving.registry.models import UsageRecord

    return UsageRecord.objects.create(
        tenant=tenant, api_key_prefix=key, request_id=f"req-{uuid.uuid4().hex}", endpoint="chat",
        model=adapter or "tiny", adapter=adapter, version=version, prompt_tokens=prompt, completion_tokens=completion,
        status=status, http_status=200 if status == "ok" else 502, latency_ms=latency, ttft_ms=None, degraded=False,
        worker="w1", created_at=timezone.now() - ago)
