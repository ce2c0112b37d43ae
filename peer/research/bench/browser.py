"""Headless Chromium driven over the DevTools protocol on a pipe, to time a page's first paint in real time.

`--virtual-time-budget` (what the browser test uses to let scripts run before `--dump-dom`) runs
the page on a virtual clock that stands still while the network works, so a page's own
`performance.now()` there leaves out its fetches. Here the page runs on the real clock instead:
Chromium is started with `--remote-debugging-pipe` (commands on fd 3, answers on fd 4, each a JSON
message ending in NUL; stdlib only, no websocket), a tab navigates to the URL and the tab is asked
every few milliseconds for the value the page sets once it has painted.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import time
from typing import Any


class Chromium:
    """One headless Chromium process and its DevTools pipe; use as a context manager."""

    def __init__(self, binary: str) -> None:
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds() -> None:  # in the child: commands on fd 3, answers on fd 4 (via copies: a pipe may be 3 or 4)
            r, w = os.dup(to_child_r), os.dup(from_child_w)
            os.dup2(r, 3)
            os.dup2(w, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=fds,
            pass_fds=(3, 4),  # kept open after `fds` ran
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._next, self._buffer = 0, b""

    def call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None, timeout_s: float = 30
    ) -> Any:
        """Send one command and wait for its answer (events in between are skipped)."""
        self._next += 1
        message: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_child], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer {method} within {timeout_s} s")
            chunk = os.read(self._from_child, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe")
            self._buffer += chunk

    def first_paint(self, url: str, expression: str, timeout_s: float = 30) -> tuple[float, float]:
        """(the page's own value of `expression` once it is set, wall seconds from the navigation
        command until it was seen) for `url` in a fresh tab."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        began = time.perf_counter()
        self.call("Page.navigate", {"url": url}, session)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
            value = got.get("result", {}).get("value")
            if value:
                wall = time.perf_counter() - began
                self.call("Target.closeTarget", {"targetId": target})
                return float(value), wall
            time.sleep(0.005)
        raise TimeoutError(f"{url} did not paint within {timeout_s} s")

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):  # it may be gone already
            self.call("Browser.close", timeout_s=5)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_child)
        os.close(self._from_child)
