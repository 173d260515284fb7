"""Open every page of the documentation site in a real browser, as a reader at 1280 px sees it.

Runs on a developer's machine, before a change to ``docs/`` lands (the README's development
section): it builds the site (``mkdocs build --strict``), serves it on 127.0.0.1, and opens each
page in headless Chromium at 1280 x 900, through Debian's ``chromium`` and ``chromium-driver``
with ``selenium``, which then downloads no browser of its own. A page fails where

- the page scrolls sideways, or a table is wider than the page's content (its last column is off
  screen);
- an image does not load;
- a link inside the site leads to no page, or to no heading of that page.

It prints one line per page it opened and exits with 1 if any page failed::

    python docs/check_pages.py [--chromium /usr/bin/chromium] [--chromedriver /usr/bin/chromedriver]
"""

from __future__ import annotations

import argparse
import functools
import html.parser
import http.server
import os
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selenium import webdriver

ROOT = Path(__file__).resolve().parent.parent
WIDTH, HEIGHT = 1280, 900
#: Chromium's flags for this machine's closed network: without the background ones it tries to
#: reach Google's hosts at every start, and is refused.
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)

#: What the browser measures on a page: the content's width, each table's and image's, and the links.
#: A table's width runs from the content's left edge to its farthest cell's right edge, where the
#: browser laid it out: a table that scrolls inside a box of its own is as wide as its cells.
MEASURE = """
const content = document.querySelector('article') || document.querySelector('[role=main]');
const style = getComputedStyle(content);
const left = content.getBoundingClientRect().left + parseFloat(style.paddingLeft);
const width = content.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
const name = (table) => (table.querySelector('th') || table).textContent.trim().slice(0, 40);
const reach = (table) => Math.max(
  table.scrollWidth, ...[...table.querySelectorAll('th, td')].map((cell) => cell.getBoundingClientRect().right - left),
);
return {
  title: document.title,
  viewport: window.innerWidth,
  page_width: document.scrollingElement.scrollWidth,
  content_width: width,
  tables: [...content.querySelectorAll('table')].map((t) => ({name: name(t), width: reach(t)})),
  images: [...content.querySelectorAll('img')].map((i) => ({
    src: i.getAttribute('src'), loaded: i.complete && i.naturalWidth > 0, width: i.getBoundingClientRect().width,
  })),
  links: [...document.querySelectorAll('a[href]')].map((a) => a.href),
};
"""


@dataclass
class PageReport:
    """What one page showed: its path in the site, what it holds and what failed on it."""

    path: str
    tables: int = 0
    widest_table: float = 0.0
    content_width: float = 0.0
    page_width: float = 0.0
    images: int = 0
    links: int = 0
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        verdict = "ok  " if not self.problems else "FAIL"
        widest = f"widest {self.widest_table:.0f} of {self.content_width:.0f} px" if self.tables else "no table"
        sideways = "no sideways scroll" if self.page_width <= WIDTH else f"{self.page_width:.0f} px wide"
        head = f"{verdict} {self.path or '/'}: {sideways}; {self.tables} table(s), {widest}"
        head += f"; {self.images} image(s) loaded"
        head += f"; {self.links} link(s) inside the site"
        return "\n".join([head, *(f"       - {problem}" for problem in self.problems)])


class _Ids(html.parser.HTMLParser):
    """The ``id`` of every element of a page: the anchors a link may name."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(value for name, value in attrs if name == "id" and value)


class SiteLinks:
    """Runs in the check: whether a link inside the site reaches a page and the heading it names."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self._pages: dict[str, set[str] | None] = {}

    def inside(self, url: str) -> bool:
        return url.startswith(self.origin)

    def problem(self, url: str) -> str | None:
        """What is wrong with ``url``, or ``None``."""
        page, _, anchor = url.partition("#")
        ids = self._ids(page)
        if ids is None:
            return f"broken link: {url[len(self.origin) :]} is no page of the site"
        if anchor and urllib.parse.unquote(anchor) not in ids:
            return f"broken link: {url[len(self.origin) :]} names no heading of that page"
        return None

    def _ids(self, page: str) -> set[str] | None:
        """The ids of ``page``'s elements (none for a file that is not a page); ``None`` if the
        site has no such page or file."""
        if page not in self._pages:
            try:
                with urllib.request.urlopen(page) as answer:
                    is_page = answer.headers.get_content_type() == "text/html"
                    body = answer.read().decode("utf-8", "replace") if is_page else ""
            except urllib.error.HTTPError:
                self._pages[page] = None
            else:
                parser = _Ids()
                parser.feed(body)
                self._pages[page] = parser.ids
        return self._pages[page]


def build(site: Path) -> None:
    """Build the site into ``site`` as the suite does, ``--strict``."""
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT,
        check=True,
        # Material's notice of its end of life (mkdocs.yml) would head every check's output
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@contextmanager
def served(site: Path) -> Iterator[str]:
    """Serve ``site`` on 127.0.0.1 from a thread of this process; yields its origin."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@contextmanager
def browser(chromium: str, chromedriver: str, profile: Path) -> Iterator[webdriver.Chrome]:
    """Headless Chromium at ``WIDTH`` x ``HEIGHT``, driven through ``chromedriver``; quit at the end.
    selenium is imported here, so that the rest (the build, the server, the link check) serves the
    suite's tests without the ``docs`` extra."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = chromium
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def check_page(driver: webdriver.Chrome, links: SiteLinks, url: str) -> tuple[PageReport, list[str]]:
    """Open ``url`` and measure it; its report, and the pages of the site it links to."""
    driver.get(url)
    seen: dict[str, Any] = driver.execute_script(MEASURE)
    report = PageReport(url[len(links.origin) :], content_width=seen["content_width"], page_width=seen["page_width"])
    if seen["viewport"] != WIDTH:
        report.problems.append(f"the window is {seen['viewport']} px wide, not {WIDTH}")
    if seen["page_width"] > seen["viewport"]:
        report.problems.append(f"the page scrolls sideways: {seen['page_width']} px in a {seen['viewport']} px window")
    for table in seen["tables"]:
        report.tables += 1
        report.widest_table = max(report.widest_table, table["width"])
        if table["width"] > seen["content_width"] + 1:
            over = table["width"] - seen["content_width"]
            report.problems.append(f"table '{table['name']}' is {over:.0f} px wider than the page's content")
    for image in seen["images"]:
        if not image["loaded"]:
            report.problems.append(f"image {image['src']} does not load")
        elif image["width"] > seen["content_width"] + 1:
            report.problems.append(f"image {image['src']} is wider than the page's content")
        else:
            report.images += 1
    inside = sorted({link for link in seen["links"] if links.inside(link)})
    report.links = len(inside)
    report.problems.extend(problem for link in inside if (problem := links.problem(link)) is not None)
    pages = sorted({link.partition("#")[0] for link in inside if not Path(link.partition("#")[0]).suffix})
    return report, pages


def check_site(chromium: str, chromedriver: str) -> list[PageReport]:
    """Build, serve and open every page reachable from the first one, in the order found."""
    with tempfile.TemporaryDirectory(prefix="lightning_monarch_docs_") as scratch:
        site = Path(scratch) / "site"
        build(site)
        with served(site) as origin, browser(chromium, chromedriver, Path(scratch) / "profile") as driver:
            links = SiteLinks(origin)
            to_open, opened, reports = [origin], set(), []
            while to_open:
                url = to_open.pop(0)
                if url in opened:
                    continue
                opened.add(url)
                report, pages = check_page(driver, links, url)
                reports.append(report)
                to_open.extend(page for page in pages if page not in opened)
            unopened = sorted(
                str(page.parent.relative_to(site))
                for page in site.rglob("index.html")
                if origin + _url(page, site) not in opened
            )
            if unopened:
                reports[0].problems.append(f"pages no link reaches: {unopened}")
    return reports


def _url(page: Path, site: Path) -> str:
    """The address of ``page`` (an ``index.html``) under the site's origin."""
    folder = page.parent.relative_to(site).as_posix()
    return "" if folder == "." else folder + "/"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chromium", default="/usr/bin/chromium", help="the Chromium to open the pages in")
    parser.add_argument("--chromedriver", default="/usr/bin/chromedriver", help="its driver")
    options = parser.parse_args(argv)
    for program in (options.chromium, options.chromedriver):
        if not Path(program).exists():
            parser.error(f"{program} is not there: install Debian's `chromium` and `chromium-driver` (apt-get install)")
    reports = check_site(options.chromium, options.chromedriver)
    for report in reports:
        print(report.line())
    failed = [report for report in reports if report.problems]
    print(f"{len(reports)} page(s) opened at {WIDTH} x {HEIGHT}; {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
