"""Seeds the three tiers of the design seed (tenants/tiers.py says where each figure comes from)."""

from django.db import migrations

from tenants.tiers import DEFAULT_TIERS


def seed(apps, schema_editor):
    Tier = apps.get_model("tenants", "Tier")
    for values in DEFAULT_TIERS:
        Tier.objects.update_or_create(name=values["name"], defaults=values)


def unseed(apps, schema_editor):
    apps.get_model("tenants", "Tier").objects.filter(name__in=[t["name"] for t in DEFAULT_TIERS]).delete()


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]
    operations = [migrations.RunPython(seed, unseed)]
