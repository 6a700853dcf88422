"""The pictures of docs/guide/generation.md: ``relprop explain-text`` on SmolLM2, and its page in a browser.

    python examples/generation_page.py [--out docs/guide/generation]

Runs ``relprop explain-text`` on a prompt whose generation alternates words and new lines, copies its
``relevance.png`` to ``OUT/relevance.png``, opens its ``generation.html`` in headless Chromium (Debian's
``chromium`` and ``chromium-driver``, driven by Selenium: ``pip install selenium``), moves the mouse over one
generated token and saves the page as ``OUT/page.png``. tests/test_browser.py starts Chromium the same way.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

from relprop.cli import main as relprop_main

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
#: headless, and nothing of its own over the network (updates, sync, QUIC probes, first-run pages)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium(profile: Path, width: int = 1000, height: int = 800) -> webdriver.Chrome:
    """Debian's Chromium under its chromedriver, with a fresh profile in ``profile``; its console and its
    network events (Chrome DevTools performance log) are kept for ``get_log("browser")`` and
    ``get_log("performance")``."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in [*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Three fruits:\n- apple\n-")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--hover", type=int, default=9, help="the generated token to point at (0 is the first)")
    parser.add_argument("--out", type=Path, default=Path("docs/guide/generation"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        written = Path(folder) / "explained"
        code = relprop_main(["explain-text", args.prompt, "--max-new-tokens", str(args.max_new_tokens),
                             "--out", str(written)])
        if code:
            raise SystemExit(code)
        args.out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(written / "relevance.png", args.out / "relevance.png")
        browser = chromium(Path(folder) / "profile", width=900)
        try:
            browser.get((written / "generation.html").resolve().as_uri())
            token = browser.find_elements(By.CSS_SELECTOR, ".gen")[args.hover]
            ActionChains(browser).move_to_element(token).perform()
            browser.find_element(By.TAG_NAME, "body").screenshot(str(args.out / "page.png"))
        finally:
            browser.quit()
    print(f"-> {args.out / 'page.png'}, {args.out / 'relevance.png'}")


if __name__ == "__main__":
    main()
