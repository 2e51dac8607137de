#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""
import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lora_platform.settings")
    from django.core.exceptions import ImproperlyConfigured
    from django.core.management import execute_from_command_line

    from runtime.settings import SettingsError

    try:
        execute_from_command_line(sys.argv)
    except (ImproperlyConfigured, SettingsError) as error:
        # Settings it refuses (lora_platform.settings) are the operator's to fix: the message, not a traceback.
        if isinstance(error, SettingsError) or str(error).startswith("Loraplex refuses"):
            sys.exit(f"{error}\nSettings come from the environment and .env (docs/operations.md, \"Settings\").")
        raise


if __name__ == "__main__":
    main()
