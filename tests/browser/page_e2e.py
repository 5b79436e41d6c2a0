"""The chat page in a real browser: headless Chromium (the system's), driven by Playwright.

Run by tests/test_web_page.py in a process of its own (Playwright's sync API keeps its own event
loop): ``python page_e2e.py URL SCREENSHOT [CHROMIUM]``. Prints one JSON line of what it saw; an
assertion error (exit 1) says what the page did not show.
"""

from __future__ import annotations

import json
import sys

from playwright.sync_api import expect, sync_playwright

TIMEOUT = 20_000  # ms, for each thing the page must show


def main(url: str, screenshot: str, chromium: str) -> None:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 900, "height": 700})
        page.set_default_timeout(TIMEOUT)
        page.goto(url)
        thread = page.locator("#thread").inner_text()
        assert thread.startswith("thread-"), thread

        # Streamed text.
        page.fill("#prompt", "hello there")
        page.click("#send")
        expect(page.locator(".assistant").last).to_have_text("You said: hello there")
        expect(page.locator("#status")).to_have_text("idle")

        # A tool call that asks for approval: approve it, see the call, its result and the answer.
        page.fill("#prompt", "add 2 and 40")
        page.click("#send")
        question = page.locator(".question").last
        expect(question).to_contain_text("approval required to run 'add'")
        question.get_by_role("button", name="Approve").click()
        expect(page.locator(".tool").last).to_contain_text("→ 42")
        expect(page.locator(".assistant").last).to_have_text("The tool returned: 42")
        expect(page.locator("#status")).to_have_text("idle")

        # A long run, stopped with the button.
        page.fill("#prompt", "wait for a while")
        page.click("#send")
        expect(page.locator(".tool").last).to_contain_text("wait(")
        expect(page.locator("#stop")).to_be_enabled()
        page.click("#stop")
        expect(page.locator(".note").last).to_have_text("stopped")
        expect(page.locator("#status")).to_have_text("idle")

        # A reload: the same thread, its conversation read back from the server.
        page.reload()
        expect(page.locator("#thread")).to_have_text(thread)
        expect(page.locator(".user")).to_have_count(3)
        expect(page.locator(".assistant").first).to_have_text("You said: hello there")
        expect(page.locator(".tool").first).to_contain_text("→ 42")
        page.screenshot(path=screenshot, full_page=True)
        users = page.locator(".user").all_inner_texts()
        browser.close()
    print(json.dumps({"thread": thread, "users": users}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "/usr/bin/chromium")
