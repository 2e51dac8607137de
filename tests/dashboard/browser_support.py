"""What the browser suites share: Debian's Chromium under Playwright (never a downloaded browser),
the screenshot helper, and the dashboard's action dialog (a reason, a canary's weight)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
LAPTOP = {"width": 1280, "height": 860}
PHONE = {"width": 390, "height": 844}


def require_chromium() -> None:
    """Skips without Debian's Chromium, with the package to install; fails instead under CI=true."""
    if CHROMIUM.exists():
        return
    message = f"{CHROMIUM} is missing: install Debian's 'chromium' package (apt-get install -y chromium)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def launched_browser() -> Iterator[object]:
    """A headless Chromium for a module's tests (the body of each suite's `browser` fixture)."""
    require_chromium()
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs an event loop in this thread, and Django then refuses database calls
    # here (fixtures, the in-thread worker's setup) as if they came from async code. Nothing async of
    # ours runs in this thread, so the check is off while the browser is up (Django's documented switch).
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
            try:
                yield launched
            finally:
                launched.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


class Shots:
    """Saves a page at laptop and phone widths when LORAPLEX_SCREENSHOTS names a directory."""

    def __init__(self, browser) -> None:
        directory = os.environ.get("LORAPLEX_SCREENSHOTS")
        self.directory = Path(directory) if directory else None
        self.browser = browser

    def take(self, page, name: str, *, phone_too: bool = True) -> None:
        """`phone_too=False` for a page that is the answer to a POST (it cannot be loaded again)."""
        if self.directory is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(self.directory / f"{name}.png"), full_page=True)
        if not phone_too:
            return
        phone = self.browser.new_context(viewport=PHONE, storage_state=page.context.storage_state())
        try:
            other = phone.new_page()
            other.goto(page.url)
            other.wait_for_load_state("networkidle")
            other.wait_for_timeout(300)
            other.screenshot(path=str(self.directory / f"{name}-phone.png"), full_page=True)
        finally:
            phone.close()


def confirm_action(page, *, reason: str = "", weight: int | None = None) -> None:
    """Answers the dashboard's action dialog (opened by the click before): the reason, a canary's
    weight in percent, then OK."""
    from playwright.sync_api import expect

    dialog = page.locator("#action-dialog")
    expect(dialog).to_be_visible()
    if weight is not None:
        page.fill("#action-dialog-weight", str(weight))
    if reason:
        page.fill("#action-dialog-reason", reason)
    page.click("#action-dialog-ok")
