"""The REST API's shared pieces, used by every app's `api.py` and named by the settings.

`errors`: OpenAI's error body on every API error (DRF's exception handler, and `error_response` for
code outside DRF); `pagination`: the one list shape and its cursor; `schema`: the OpenAPI schema's
AutoSchema, which documents each operation's error answers. No app's rules live here.
"""
