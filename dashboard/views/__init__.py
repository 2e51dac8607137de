"""The dashboard's views, one module per section (dashboard/urls.py maps them)."""
