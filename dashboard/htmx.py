"""htmx's side of a dashboard request: a fragment for htmx's polling, a redirect it follows."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, HttpResponseRedirect


def is_htmx(request: HttpRequest) -> bool:
    """Whether htmx sent the request (it then wants a fragment, not a whole page)."""
    return request.headers.get("HX-Request") == "true"


def htmx_redirect(request: HttpRequest, url: str) -> HttpResponse:
    """A redirect that htmx follows as a full page load (HX-Redirect), or a plain 302."""
    if is_htmx(request):
        response = HttpResponse(status=204)
        response["HX-Redirect"] = url
        return response
    return HttpResponseRedirect(url)
