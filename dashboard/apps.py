from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"
    verbose_name = "Tenant dashboard"

    def ready(self) -> None:
        from django.contrib.auth.signals import user_logged_out

        from dashboard.views.playground import playground_keys_revoke

        user_logged_out.connect(playground_keys_revoke, dispatch_uid="dashboard.playground_keys_revoke")
