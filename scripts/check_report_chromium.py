"""Render a run's report.html in headless Chromium and check it: `python scripts/check_report_chromium.py RUN_DIR`.

Checks that
- the page's script ran to the end and raised nothing: the DOM Chromium dumps carries `data-rendered="ok"` and no
  `data-js-error` (the page sets both from its own script and its window error handler), and Chromium's console
  log has no "Uncaught" error;
- the page fetches nothing: it has no http(s) URL in a src/href attribute;
- the screenshot is not blank: enough non-white pixels in enough colours (the PNG is read with Pillow when it is
  installed, else with the standard library, so the check needs no Python packages).

The report is built first when RUN_DIR has none (`scripts/report.py`). Needs Chromium (Debian: `apt-get install
chromium`; CHROMIUM=path to use another binary). Writes RUN_DIR/report_screenshot.png (or --screenshot PATH).
Exit status 0 when every check passes, 1 when one fails, 2 when Chromium or the report is missing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

WIDTH, HEIGHT = 1400, 2200


def find_chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def chromium(binary: str, args: list[str], profile: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    base = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
            "--disable-extensions", "--disable-background-networking", "--hide-scrollbars",
            f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000"]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=timeout)


def read_png(path: str) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB(A) bytes) of an 8-bit RGB or RGBA, non-interlaced PNG (what Chromium writes)."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, idat, width = 8, b"", 0
    height = depth = ctype = interlace = 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    if depth != 8 or ctype not in (2, 6) or interlace:
        raise ValueError(f"unsupported PNG (bit depth {depth}, colour type {ctype}, interlace {interlace})")
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(height):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, rows


def _rows(path: str) -> tuple[int, int, int, list[bytes]]:
    """(width, height, bytes per pixel, rows): through Pillow when it is installed (fast), else `read_png`."""
    try:
        from PIL import Image
    except ImportError:
        width, height, rows = read_png(path)
        return width, height, (len(rows[0]) // width if rows else 3), rows
    im = Image.open(path).convert("RGB")
    raw = im.tobytes()
    stride = im.width * 3
    return im.width, im.height, 3, [raw[y * stride:(y + 1) * stride] for y in range(im.height)]


def pixel_stats(path: str) -> tuple[float, int]:
    """(share of pixels that are not (near) white, number of distinct coarse colours) on a 4-pixel grid."""
    width, height, bpp, rows = _rows(path)
    total = inked = 0
    colours = set()
    for y in range(0, height, 4):
        row = rows[y]
        for x in range(0, width, 4):
            r, g, b = row[x * bpp], row[x * bpp + 1], row[x * bpp + 2]
            total += 1
            if min(r, g, b) < 235:
                inked += 1
            colours.add((r >> 4, g >> 4, b >> 4))
    return (inked / total if total else 0.0), len(colours)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--screenshot", default="", help="where to write the screenshot (default RUN_DIR/...)")
    ap.add_argument("--min-ink", type=float, default=0.05, help="least share of non-white pixels")
    args = ap.parse_args(argv)
    page = os.path.abspath(os.path.join(args.run_dir, "report.html"))
    if not os.path.exists(page):
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "report.py")
        subprocess.run([sys.executable, script, args.run_dir], check=False)
    if not os.path.exists(page):
        print(f"FAIL: no report.html in {args.run_dir}", file=sys.stderr)
        return 2
    binary = find_chromium()
    if binary is None:
        print("FAIL: no Chromium found (apt-get install chromium, or set CHROMIUM=...)", file=sys.stderr)
        return 2
    shot = os.path.abspath(args.screenshot or os.path.join(args.run_dir, "report_screenshot.png"))
    failures: list[str] = []
    html = open(page, encoding="utf-8").read()
    remote = re.findall(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.I)
    if remote:
        failures.append(f"the page refers to {len(remote)} network resource(s)")
    url = "file://" + page
    with tempfile.TemporaryDirectory(prefix="arl-chromium-") as profile:
        dom = chromium(binary, ["--dump-dom", url], profile)
        if 'data-rendered="ok"' not in dom.stdout:
            failures.append("the page's script did not finish (no data-rendered=\"ok\" in the DOM)"
                            + (f"; chromium exited {dom.returncode}: {dom.stderr[-800:]}" if dom.returncode else ""))
        m = re.search(r'data-js-error="([^"]*)"', dom.stdout)
        if m:
            failures.append(f"script error on the page: {m.group(1)}")
        if os.path.exists(shot):
            os.remove(shot)
        ss = chromium(binary, [f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}", url], profile)
    logs = dom.stderr + ss.stderr
    console = [ln for ln in logs.splitlines() if "Uncaught" in ln or ("CONSOLE" in ln and "ERROR" in ln.upper()
                                                                      and "report.html" in ln)]
    if console:
        failures.append("console errors:\n  " + "\n  ".join(console[:10]))
    if not os.path.exists(shot):
        failures.append(f"no screenshot (chromium exited {ss.returncode}): {ss.stderr[-800:]}")
    else:
        ink, colours = pixel_stats(shot)
        print(f"screenshot {shot}: {ink:.1%} non-white pixels, {colours} colours")
        if ink < args.min_ink or colours < 8:
            failures.append(f"the screenshot looks blank ({ink:.1%} non-white pixels, {colours} colours)")
    if failures:
        for f in failures:
            print("FAIL:", f, file=sys.stderr)
        return 1
    print(f"OK: {page} renders in {os.path.basename(binary)} without script errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
