"""Usage records get an id of their own (record_id, what makes a record pushed twice written once)
and request_id, now the request's X-Request-ID (which a caller may choose), stops being unique.

The existing rows' request ids were minted by the gateway and are unique: they become their record
ids, in one UPDATE; 0004 then makes record_id unique."""

from django.db import migrations, models
from django.db.models import F


def record_ids_from_request_ids(apps, schema_editor):
    apps.get_model("serving", "UsageRecord").objects.update(record_id=F("request_id"))


class Migration(migrations.Migration):

    dependencies = [
        ("serving", "0002_usagerecord"),
    ]

    operations = [
        migrations.AddField(
            model_name="usagerecord",
            name="record_id",
            field=models.CharField(max_length=64, null=True),
        ),
        migrations.RunPython(record_ids_from_request_ids, migrations.RunPython.noop),
        migrations.AlterField(
            model_name="usagerecord",
            name="request_id",
            field=models.CharField(db_index=True, max_length=64),
        ),
    ]
