"""A real headless browser for HTML the tests must see rendered: Debian's chromium (``make system-deps``)."""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--mute-audio",
)


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not found:
        raise RuntimeError("no chromium on the PATH: `make system-deps` installs Debian's")
    return found


def rendered_dom(page: Path | str, profile: Path, timeout_s: int = 120) -> str:
    """The DOM of ``page`` (a file, or a URL) after the browser loaded it and ran its scripts."""
    proc = subprocess.run(
        [
            chromium(),
            *FLAGS,
            f"--user-data-dir={profile}",
            "--virtual-time-budget=10000",
            "--dump-dom",
            page.resolve().as_uri() if isinstance(page, Path) else page,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0 and "<html" in proc.stdout, proc.stderr[-2000:]
    return proc.stdout


def screenshot(page: Path, png: Path, profile: Path, size: str = "1400,2400", timeout_s: int = 120) -> None:
    subprocess.run(
        [
            chromium(),
            *FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={size}",
            f"--screenshot={png}",
            page.resolve().as_uri(),
        ],
        capture_output=True,
        timeout=timeout_s,
        check=True,
    )


class DomCounts(HTMLParser):
    """Counts of what a rendered DOM holds: images (with their sources), rows per table id, body attributes."""

    def __init__(self, dom: str):
        super().__init__()
        self.images: list[str] = []
        self.rows: dict[str, int] = {}
        self.row_ids: dict[str, list[str]] = {}
        self.body: dict[str, str] = {}
        self._tables: list[str] = []
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a.get("src") or "")
        elif tag == "body":
            self.body = {k: v or "" for k, v in attrs}
        elif tag == "table":
            self._tables.append(a.get("id") or "")
        elif tag == "tr" and self._tables and "data-image-id" in a:
            t = self._tables[-1]
            self.rows[t] = self.rows.get(t, 0) + 1
            self.row_ids.setdefault(t, []).append(a["data-image-id"])

    def handle_endtag(self, tag):
        if tag == "table" and self._tables:
            self._tables.pop()


VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class FormLabels(HTMLParser):
    """The labels of a Prefect UI schema form, in order, each with how many object boxes (a nested parameter's
    ``schema-form-property-object``) it sits in: ``labels`` = [(text, depth)]."""

    def __init__(self, dom: str):
        super().__init__()
        self.labels: list[tuple[str, int]] = []
        self._open: list[bool] = []  # per open element: is it an object box
        self._label: list[str] | None = None
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "span" and "schema-form-property__label" in classes:
            self._label = []
        if tag not in VOID:
            self._open.append("schema-form-property-object" in classes)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if self._label is not None and tag == "span":
            self.labels.append(("".join(self._label).strip(), sum(self._open[:-1])))
            self._label = None
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        if self._label is not None:
            self._label.append(data)
