"""Headless Chromium for the dashboard's tests: the binary (None when none is installed) and `browse`.

`browse(url)` returns the DOM after the page's scripts ran (`--virtual-time-budget`, then `--dump-dom`);
with flags (`--screenshot=FILE`) it does what they say instead."""

from __future__ import annotations

import html
import re
import shutil
import subprocess

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
NO_CHROMIUM = "no chromium binary (apt-get install chromium): the dashboard's browser tests need one"
HEADLESS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]


def browse(url: str, *flags: str) -> str:
    """The DOM of `url` after its scripts ran (or what `flags` make Chromium do)."""
    out = subprocess.run(
        [str(CHROMIUM), *HEADLESS, *flags, *(() if flags else ("--dump-dom",)), url],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def element(dom: str, tag: str, ident: str) -> str:
    """The markup of the element <tag id=ident …>…</tag> (no nesting of the same tag inside)."""
    found = re.search(rf'<{tag}[^>]*id="{ident}"[^>]*>(.*?)</{tag}>', dom, re.S)
    assert found, f"no <{tag} id={ident}> in the page"
    return found.group(0)


def cells(markup: str) -> list[str]:
    """The text of every table cell in `markup`, in order."""
    found = re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", markup, re.S)
    return [html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in found]
