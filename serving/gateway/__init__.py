"""The public OpenAI-compatible gateway (`/v1/…` on the web process), Django only at its edge.

Edge (may import Django): `asgi` (the completion routes' one entry point), `views` (`/v1/models`,
`/metrics`), `catalog` (the database port: keys, tiers, served versions, cached per process) and
`wiring` (builds the pipeline from the settings). Everything else is Django-free and named in an
import-linter contract: `pipeline` (the request path) over `records` and the `ports` it is handed,
`resilience` and the policies (`quotas`, `version_pick`, `routing`, `proxy`, `failover`,
`outliers`, `shedding`, `canary_rule`, `prewarm*`, ...), each tested alone. The
circuit breaker and the Redis guard, which the serving worker runs too, are in runtime.
docs/gateway.md describes the behaviour and the layout.
"""
