"""The tenant dashboard (`/`): server-rendered pages over the apps' services and selectors.

As healthchecks keeps its UI in `hc/front/`, this app holds the dashboard's views (`views/`, one
module per section), its URLs (`urls.py`, namespace `dashboard`), its templates and their includes
(`templates/dashboard/`), and the request plumbing every view shares (`tenancy.py`: which tenant,
which role; `htmx.py`). It holds no model and no rule: each action is one call of an app's service.
"""
