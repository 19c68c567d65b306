"""Open a ``flatcli report`` page in headless Chromium with the network off: take a screenshot, and
fail on any console message or any request the page makes.

    python tools/check_report_browser.py [flatcli-demo/report.html] [--screenshot docs/img/report_demo.png]

Debian's ``chromium`` package (``/usr/bin/chromium``; the script waits ``--wait`` seconds for it
to appear, e.g. while apt installs it). The network is off twice over: every request goes to a
proxy on a closed port and every host name resolves to nothing. Two runs:

1. ``--screenshot`` with ``--enable-logging=stderr --v=0`` (every console message is logged as
   ``INFO:CONSOLE``) and ``--log-net-log`` (every request the browser makes). Requests the
   page made have an initiator (``null`` for a file: page); the browser's own background
   requests (updates, time) say ``not an origin`` and are not the page's.
2. ``--dump-dom``: the parsed page holds the ranking table and one scatter figure per measure,
   as many as the file does.

The screenshot is scaled to ``--scale-width`` pixels wide, in 256 colours (Pillow, when installed). Prints a
JSON summary; exit code 1 when the page logged to the console, made a request or lost a figure.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--hide-scrollbars",
    "--proxy-server=127.0.0.1:9",
    "--host-resolver-rules=MAP * ~NOTFOUND",
]


def wait_for(binary: str, seconds: float) -> str:
    """The browser's path, waiting up to ``seconds`` for it to be installed."""
    end = time.monotonic() + seconds
    while True:
        found = shutil.which(binary) or (binary if Path(binary).is_file() else None)
        if found:
            return found
        if time.monotonic() > end:
            sys.exit(f"error: {binary} not found (apt-get install chromium)")
        time.sleep(10)


def page_requests(netlog: Path) -> list[str]:
    """The URLs the page requested (an initiator that is an origin or ``null``), not file: or data:."""
    try:
        events = json.loads(netlog.read_text()).get("events", [])
    except (OSError, ValueError):  # a net log cut short: read it as text
        text = netlog.read_text(errors="replace")
        return sorted(
            set(re.findall(r'"initiator":"(?!not an origin)[^"]*","[^}]*?"url":"([^"]+)"', text))
        )
    urls = set()
    for e in events:
        p = e.get("params") or {}
        url, initiator = p.get("url"), p.get("initiator")
        if url and initiator is not None and initiator != "not an origin":
            if not url.startswith(("file:", "data:")):
                urls.add(url)
    return sorted(urls)


def run(browser: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="flatcli-chromium-") as profile:
        return subprocess.run(
            [browser, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def scale(png: Path, width: int) -> None:
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(png) as im:
        if im.width > width:
            im = im.resize((width, round(im.height * width / im.width)), Image.LANCZOS)
        # 256 colours: a page of text and flat plots loses nothing visible, the file a third
        im.convert("RGB").quantize(256).save(png, optimize=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", nargs="?", type=Path, default=Path("flatcli-demo/report.html"))
    ap.add_argument("--screenshot", type=Path, default=ROOT / "docs" / "img" / "report_demo.png")
    ap.add_argument("--window", default="1280,2200", help="window size W,H of the screenshot")
    ap.add_argument("--scale-width", type=int, default=960)
    ap.add_argument("--browser", default="/usr/bin/chromium")
    ap.add_argument("--wait", type=float, default=600, help="seconds to wait for the browser")
    ap.add_argument("--timeout", type=float, default=180)
    a = ap.parse_args()
    page = a.page.resolve()
    if not page.is_file():
        sys.exit(f"error: {page} not found (run `flatcli demo` first, or name a report.html)")
    browser = wait_for(a.browser, a.wait)
    url = page.as_uri()
    a.screenshot.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flatcli-netlog-") as tmp:
        netlog = Path(tmp) / "net.json"
        shot = run(
            browser,
            ["--enable-logging=stderr", "--v=0", f"--log-net-log={netlog}",
             f"--window-size={a.window}", f"--screenshot={a.screenshot.resolve()}", url],
            a.timeout,
        )  # fmt: skip
        requests = page_requests(netlog)
    console = [line for line in shot.stderr.splitlines() if ":INFO:CONSOLE" in line]
    dom = run(browser, ["--dump-dom", url], a.timeout).stdout
    source = page.read_text()
    want = source.count('<figure class="scatter"')
    got = dom.count('<figure class="scatter"')
    if a.screenshot.is_file():
        scale(a.screenshot, a.scale_width)
    summary = {
        "page": str(page),
        "bytes": page.stat().st_size,
        "screenshot": str(a.screenshot) if a.screenshot.is_file() else None,
        "console_messages": console,
        "page_requests": requests,
        "scatters_in_file": want,
        "scatters_in_dom": got,
        "ranking_table": 'id="ranking-table"' in dom,
    }
    print(json.dumps(summary, indent=1))
    ok = (
        not console
        and not requests
        and want == got > 0
        and summary["ranking_table"]
        and summary["screenshot"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
