"""The public OpenAI-compatible gateway (`/v1/…` on the web process).

Thin async Django views (`views`) over one request path (`pipeline`) that calls policy modules
without Django, each tested alone: `quotas` (Redis token buckets), `version_pick` (canary weight,
sticky users), `routing` (worker choice from the Redis worker registry), `proxy` (the upstream
call and SSE passthrough), `usage_log` (usage records off the request path) and `metrics`.
`catalog` is the Django side: API keys, tiers and served versions, cached per process.
docs/gateway.md describes the behaviour.
"""
