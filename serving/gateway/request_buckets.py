"""The token buckets one request takes from: its tenant's (the tier's rpm and tpm) and, where its API
key has limits of its own (docs/keys.md), the key's, all admitted at once (serving.gateway.quotas).

A key's rpm and tpm are at most the tier's (tenants.key_controls), so they never widen the tenant's
quota: they share it out among the tenant's keys. The rate-limit headers describe the tightest
bucket of each kind, and a 429 names the bucket that was short. Over a key's own limit a request
is refused, never degraded: degradation spends the tenant's slack, not the key's.
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.gateway.quotas import Admission, Bucket, BucketState, ratelimit_headers
from serving.gateway.records import Caller


@dataclass(frozen=True)
class _Limit:
    """Whose bucket it is and the rate it stands for, for the 429's message."""

    owner: str
    per_minute: int
    unit: str
    own_key: bool


@dataclass(frozen=True)
class RequestBuckets:
    requests: tuple[Bucket, ...]
    tokens: tuple[Bucket, ...]
    # Degraded requests take from their own bucket, the tier's rpm (serving.gateway.pipeline.admit).
    degraded: Bucket
    limits: dict[str, _Limit]

    @classmethod
    def of(cls, caller: Caller, burst: float) -> RequestBuckets:
        """The caller's buckets, each holding `burst` minutes of its rate (the degraded one a minute's)."""
        tier, key = caller.tier, caller.key
        tenant = f"tenant '{caller.tenant}' ('{tier.name}' tier"
        own = f"API key lp-{caller.key_prefix}… (its own limit"
        requests = [(Bucket.per_minute(f"{caller.tenant}:requests", tier.requests_per_minute, burst=burst),
                     _Limit(tenant, tier.requests_per_minute, "requests", own_key=False))]
        tokens = [(Bucket.per_minute(f"{caller.tenant}:tokens", tier.tokens_per_minute, burst=burst),
                   _Limit(tenant, tier.tokens_per_minute, "tokens", own_key=False))]
        if key.requests_per_minute is not None:
            requests.append((Bucket.per_minute(f"key:{caller.key_prefix}:requests", key.requests_per_minute,
                                               burst=burst),
                             _Limit(own, key.requests_per_minute, "requests", own_key=True)))
        if key.tokens_per_minute is not None:
            tokens.append((Bucket.per_minute(f"key:{caller.key_prefix}:tokens", key.tokens_per_minute, burst=burst),
                           _Limit(own, key.tokens_per_minute, "tokens", own_key=True)))
        return cls(requests=tuple(bucket for bucket, _ in requests), tokens=tuple(bucket for bucket, _ in tokens),
                   degraded=Bucket.per_minute(f"{caller.tenant}:degraded", tier.requests_per_minute, burst=1.0),
                   limits={bucket.key: limit for bucket, limit in [*requests, *tokens]})

    def costs(self, *, tokens: float) -> list[tuple[Bucket, float]]:
        """One request and `tokens` tokens from every bucket (the order `split` reads back)."""
        return [*((bucket, 1.0) for bucket in self.requests), *((bucket, tokens) for bucket in self.tokens)]

    def degraded_costs(self) -> list[tuple[Bucket, float]]:
        """A degraded request: one from the degraded bucket, and from the key's request bucket, which
        counts every request of the key."""
        return [(self.degraded, 1.0), *((bucket, 1.0) for bucket in self.requests[1:])]

    def split(self, admission: Admission) -> tuple[list[BucketState], list[BucketState]]:
        """The states of an admission of `costs`: (requests, tokens)."""
        states = admission.states
        return states[:len(self.requests)], states[len(self.requests):]

    def headers(self, admission: Admission) -> dict[str, str]:
        """OpenAI's rate-limit headers, each kind from its tightest bucket (the fewest left)."""
        requests, tokens = self.split(admission)
        return ratelimit_headers(min(requests, key=lambda state: state.level),
                                 min(tokens, key=lambda state: state.level))

    def shortest(self, admission: Admission) -> BucketState:
        """The bucket this request waits longest for (of a refused admission)."""
        return max(admission.states, key=lambda state: state.wait_s)

    def key_short(self, admission: Admission) -> bool:
        """Whether one of the key's own buckets lacks what the request costs."""
        return any(state.wait_s > 0 and self.limits[state.bucket.key].own_key for state in admission.states)

    def describe(self, state: BucketState) -> str:
        """`tenant 'acme' ('standard' tier: 200 requests per minute)`, or the key's own limit."""
        return self.describe_bucket(state.bucket)

    def describe_bucket(self, bucket: Bucket) -> str:
        limit = self.limits[bucket.key]
        return f"{limit.owner}: {limit.per_minute} {limit.unit} per minute)"
