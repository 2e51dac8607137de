from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("training", "0003_dataset_validation_times")]

    operations = [
        migrations.AddField(model_name="trainingjob", name="metadata",
                            field=models.JSONField(blank=True, default=dict)),
    ]
