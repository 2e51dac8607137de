"""Seeds the three tiers of the design seed.

requests/min, max tokens/request and priority are the seed's; tokens/min is rpm × max tokens (the
seed gives none); job, adapter and degradation limits are Loraplex's choice: vip pays not to be
degraded (it gets 429 instead), standard and batch may fall back to the base model.
"""

from django.db import migrations

TIERS = [
    dict(name="vip", requests_per_minute=1000, tokens_per_minute=512_000, max_tokens_per_request=512,
         priority=0, max_concurrent_training_jobs=4, max_adapters=100, degradation_allowed=False),
    dict(name="standard", requests_per_minute=200, tokens_per_minute=51_200, max_tokens_per_request=256,
         priority=1, max_concurrent_training_jobs=2, max_adapters=20, degradation_allowed=True),
    dict(name="batch", requests_per_minute=50, tokens_per_minute=51_200, max_tokens_per_request=1024,
         priority=2, max_concurrent_training_jobs=1, max_adapters=10, degradation_allowed=True),
]


def seed(apps, schema_editor):
    Tier = apps.get_model("tenants", "Tier")
    for values in TIERS:
        Tier.objects.update_or_create(name=values["name"], defaults=values)


def unseed(apps, schema_editor):
    apps.get_model("tenants", "Tier").objects.filter(name__in=[t["name"] for t in TIERS]).delete()


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]
