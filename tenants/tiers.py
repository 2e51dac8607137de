"""The three tiers of the design seed, as data: the seed migration and `tiers_seed()` both use it.

requests/min, max tokens/request and priority are the seed's; tokens/min is rpm × max tokens (the
seed gives none); job, adapter and degradation limits are Loraplex's choice: vip pays not to be
degraded (it gets 429 instead), standard and batch may fall back to the base model.
"""

DEFAULT_TIERS: list[dict[str, object]] = [
    dict(name="vip", requests_per_minute=1000, tokens_per_minute=512_000, max_tokens_per_request=512,
         priority=0, max_concurrent_training_jobs=4, max_adapters=100, degradation_allowed=False),
    dict(name="standard", requests_per_minute=200, tokens_per_minute=51_200, max_tokens_per_request=256,
         priority=1, max_concurrent_training_jobs=2, max_adapters=20, degradation_allowed=True),
    dict(name="batch", requests_per_minute=50, tokens_per_minute=51_200, max_tokens_per_request=1024,
         priority=2, max_concurrent_training_jobs=1, max_adapters=10, degradation_allowed=True),
]
