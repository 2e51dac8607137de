import serving.registry.models
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("serving", "0003_usagerecord_record_id"),
    ]

    operations = [
        migrations.AlterField(
            model_name="usagerecord",
            name="record_id",
            field=models.CharField(default=serving.registry.models.usage_record_id, max_length=64, unique=True),
        ),
    ]
