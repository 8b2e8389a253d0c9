"""The live dashboard: its JSON scoping over a real server with tenant keys, the router's view across
backends, and the page itself in a real headless Chromium (Debian's ``chromium`` package), driven over
the DevTools protocol on a pipe: no console error, the hit rate and the cached prompt text shown to
its tenant, none of it to another tenant, all of it to the admin. Screenshots are kept under the test's
temporary folder and, when ``KVREUSE_ARTIFACTS_DIR`` is set, copied there.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from server_process import (
    MODEL_NAME,
    POLL,
    RunningServer,
    free_port,
    start_server,
    stop_server,
)
from test_router import start_router

from kvreuse.observatory.dashboard import (
    DashboardHistory,
    EngineReading,
    HitCounter,
    HitSampler,
    Sample,
)

KEY_A, KEY_B, ADMIN_KEY = "dash-key-tenant-a", "dash-key-tenant-b", "dash-admin-key"
# Distinctive words, so "tenant B's page shows none of A's text" is a plain substring check.
SECRET_A = "Zorblax"
SYSTEM_A = (f"You are {SECRET_A}, the billing assistant of the Quillfeather bookshop. Answer briefly and politely, "
            "quote the order number, never promise refunds, and sign every reply as the billing desk.")
SYSTEM_B = "You are the travel desk of Northwind Rail. Answer in one sentence and always name the platform."
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
PAGE_TIMEOUT_S = 20.0


# --- a real server with two tenants and an admin --------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("dashboard-server") / "server.log"
    running = start_server(tiny_model, log, "--api-key", KEY_A, "--api-key", KEY_B, "--admin-key", ADMIN_KEY,
                           "--isolate-tenants")
    try:
        # Tenant A: a shared system prompt, so the later requests hit; tenant B: one request of its own.
        for question in ("Where is my order 1182?", "Do gift cards expire?", "Can I pay by invoice?"):
            chat(running, KEY_A, SYSTEM_A, question)
        chat(running, KEY_B, SYSTEM_B, "When does the train to Leeds leave?")
        yield running
    finally:
        stop_server(running)


def chat(server: RunningServer, key: str, system: str, question: str) -> None:
    client = OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=2, temperature=0,
                                           messages=[{"role": "system", "content": system},
                                                     {"role": "user", "content": question}])
    assert reply.usage is not None and reply.usage.prompt_tokens > 0


def dashboard_json(url: str, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return POLL.get(f"{url}/v1/cache/dashboard", headers=headers, timeout=30)


def wait_for_samples(url: str, key: str, count: int = 3) -> dict[str, Any]:
    """The dashboard once the sampler has taken ``count`` samples after the requests."""
    deadline = time.monotonic() + 15
    while True:
        document = dashboard_json(url, key).json()
        if len(document["series"]["time"]) >= count:
            return document
        assert time.monotonic() < deadline, document["series"]
        time.sleep(0.3)


# --- the time series, without a server --------------------------------------------------------------------

def test_history_windows_and_scopes_the_series() -> None:
    history = DashboardHistory(capacity=5, window_s=2.0)
    for t, (query, hit) in enumerate([(0, 0), (100, 0), (200, 90), (300, 180), (300, 180), (400, 270), (500, 360)]):
        history.add(Sample(float(t), {"shared": HitCounter(query, hit), "tenant-a": HitCounter(10 * t, 5 * t)},
                           {"free": 10 - t, "idle": t, "in_use": 0, "pinned": 1}))
    assert len(history) == 5  # the oldest dropped out
    mine = history.series(lambda owner: owner == "tenant-a", include_total=False)
    assert mine["time"] == [2.0, 3.0, 4.0, 5.0, 6.0] and mine["total"] is None
    assert list(mine["owners"]) == ["tenant-a"] and "pinned" not in mine["blocks"]  # pins count every tenant's
    assert mine["owners"]["tenant-a"]["hit_rate"] == [None, 0.5, 0.5, 0.5, 0.5]  # no window before the first
    everyone = history.series(lambda owner: True, include_total=True)
    # At t=5 the window reaches back to t=3: (270 + 25 - 180 - 15) / (400 + 50 - 300 - 30) hit.
    assert everyone["total"]["hit_rate"][3] == round(100 / 120, 4)
    assert everyone["total"]["tokens_saved"] == [100, 195, 200, 295, 390]
    assert everyone["blocks"]["pinned"] == [1] * 5 and everyone["blocks"]["idle"] == [2, 3, 4, 5, 6]
    recent = history.recent({"shared": HitCounter(600, 450)}, lambda owner: owner == "shared", False, 7.0)
    assert recent["total"] is None and recent["owners"]["shared"]["recent_hit_rate"] == round(180 / 200, 4)


def test_sampler_reads_the_engine_only_when_it_moved() -> None:
    reads: list[int] = []
    marker = [0]

    async def read() -> EngineReading:
        reads.append(marker[0])
        return EngineReading({"shared": HitCounter(len(reads), 0)}, pinned_blocks=0)

    sampler = HitSampler(read, DashboardHistory(10), pool=lambda: {"free": 1, "idle": 0, "in_use": 0},
                         marker=lambda: marker[0], interval_s=0.01)

    async def run() -> None:
        await sampler.sample_once()
        await sampler.sample_once()  # nothing moved: the last reading again
        marker[0] = 1
        await sampler.sample_once()
        sampler.ensure_started()
        await asyncio.sleep(0.05)
        await sampler.stop()

    asyncio.run(run())
    assert reads == [0, 1]
    assert len(sampler.history) > 3


# --- JSON ------------------------------------------------------------------------------------------------

def test_dashboard_json_needs_a_key(server: RunningServer) -> None:
    assert dashboard_json(server.base_url, None).status_code == 401
    assert dashboard_json(server.base_url, "not-a-key").status_code == 401
    # The page and its assets carry no data: open; the config tells the page a key is needed.
    assert httpx.get(f"{server.base_url}/dashboard", timeout=10).status_code == 200
    config = httpx.get(f"{server.base_url}/dashboard/config.json", timeout=10).json()
    assert config["auth_required"] is True and config["kind"] == "server"
    plotly = httpx.get(f"{server.base_url}/dashboard/plotly.min.js", timeout=30)
    assert plotly.status_code == 200 and "plotly" in plotly.text[:2000].lower()


def test_dashboard_json_is_scoped_to_the_tenant(server: RunningServer) -> None:
    mine = wait_for_samples(server.base_url, KEY_A)
    assert mine["object"] == "cache.dashboard" and mine["scope"]["sees_all"] is False
    assert any(SECRET_A in entry["text"] for entry in mine["tree"]), mine["tree"]
    assert mine["hit_rate"]["total"] is None  # the all-tenant total is for callers that see all
    owners = mine["hit_rate"]["owners"]
    assert list(owners) == [mine["scope"]["tenant"]], owners  # its own counters only
    assert owners[mine["scope"]["tenant"]]["hit_tokens"] > 0  # the second and third requests hit
    assert mine["series"]["total"] is None and list(mine["series"]["owners"]) == list(owners)
    blocks = mine["blocks"]
    assert blocks["free"] + blocks["idle"] + blocks["in_use"] == blocks["total"] > 0

    other = dashboard_json(server.base_url, KEY_B).json()
    assert SECRET_A not in json.dumps(other)  # no text of A's anywhere in B's reply
    assert mine["scope"]["tenant"] not in json.dumps(other)  # nor A's counters

    admin = wait_for_samples(server.base_url, ADMIN_KEY)
    assert admin["scope"]["sees_all"] is True
    assert any(SECRET_A in entry["text"] for entry in admin["tree"])
    assert admin["hit_rate"]["total"]["hit_tokens"] >= owners[mine["scope"]["tenant"]]["hit_tokens"]
    assert {mine["scope"]["tenant"], other["scope"]["tenant"]} <= set(admin["series"]["owners"])
    assert len(admin["series"]["total"]["tokens_saved"]) == len(admin["series"]["time"])


# --- the router --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def router(server: RunningServer, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A router over the server and a backend that is down (nothing listens on its port)."""
    down = f"http://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("dashboard-router") / "router.log"
    url, process = start_router([server.base_url, down], tiny_model, log)
    yield url
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()


def test_router_dashboard_shows_each_backend(router: str, server: RunningServer) -> None:
    reply = dashboard_json(router, KEY_A)
    assert reply.status_code == 200, reply.text
    document = reply.json()
    assert document["object"] == "router.dashboard" and document["auth_required"] is False
    by_url = {backend["url"]: backend for backend in document["backends"]}
    assert len(by_url) == 2
    live = by_url.pop(server.base_url)
    assert live["status"] == "ok" and any(SECRET_A in entry["text"] for entry in live["dashboard"]["tree"])
    (down,) = by_url.values()
    assert down["status"] == "down" and down["dashboard"] is None
    # The caller's key went through: tenant B gets B's view, and no key gets no data.
    assert SECRET_A not in dashboard_json(router, KEY_B).text
    anonymous = dashboard_json(router, None).json()
    assert anonymous["auth_required"] is True and SECRET_A not in json.dumps(anonymous)
    assert httpx.get(f"{router}/dashboard", timeout=10).status_code == 200


# --- the page in a real browser ------------------------------------------------------------------------------

def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class ConsoleEntry:
    level: str
    text: str


@dataclass
class Page:
    """One browser tab (a DevTools session) and what its console said."""

    browser: Chromium
    session_id: str
    console: list[ConsoleEntry] = field(default_factory=list)

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.call(method, params, self.session_id)

    def open(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait_for("location.href !== 'about:blank' && document.readyState === 'complete'", f"{url} loaded")

    def evaluate(self, expression: str) -> Any:
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in reply:
            raise AssertionError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = PAGE_TIMEOUT_S) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                value = self.evaluate(expression)
            except AssertionError:  # the page is between documents (navigation): not yet
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                text = self.evaluate("document.body ? document.body.innerText : ''")
                raise AssertionError(f"the page never showed {what}; console {self.console}; page text:\n{text[:3000]}")
            time.sleep(0.2)

    def text(self) -> str:
        return self.evaluate("document.documentElement.outerHTML + '\\n' + document.body.innerText")

    def errors(self) -> list[ConsoleEntry]:
        return [entry for entry in self.console if entry.level in ("error", "assert", "exception")]

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))
        artifacts = os.environ.get("KVREUSE_ARTIFACTS_DIR")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(artifacts) / path.name)
        return path

    def close(self) -> None:
        self.browser.call("Target.closeTarget", {"targetId": self.browser.targets.pop(self.session_id)})


class Chromium:
    """Headless Chromium driven over ``--remote-debugging-pipe`` (fd 3 in, fd 4 out, NUL-separated JSON):
    no WebSocket client needed. A reader thread files replies by id and console events by session."""

    def __init__(self, binary: str, log_path: Path) -> None:
        self._profile = tempfile.mkdtemp(prefix="kvreuse-chromium-")
        to_browser_read, self._to_browser = os.pipe()
        self._from_browser, from_browser_write = os.pipe()

        def wire_pipes() -> None:  # in the child: the pipe ends at fds 3 and 4, inheritable
            inbound, outbound = os.dup(to_browser_read), os.dup(from_browser_write)
            os.dup2(inbound, 3)
            os.dup2(outbound, 4)

        command = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                   "--remote-debugging-pipe", f"--user-data-dir={self._profile}", "--no-first-run",
                   "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                   "--disable-component-update", "--disable-sync", "--enable-logging=stderr", "--v=0",
                   "--window-size=1280,1600", "about:blank"]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            preexec_fn=wire_pipes, close_fds=False)
        os.close(to_browser_read)
        os.close(from_browser_write)
        self.targets: dict[str, str] = {}  # session id -> target id
        self._pages: dict[str, Page] = {}
        self._next_id = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._condition = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._condition:
                    self._replies[-1] = {"error": {"message": "the browser closed its pipe"}}
                    self._condition.notify_all()
                return
            buffer += chunk
            while b"\0" in buffer:
                raw, buffer = buffer.split(b"\0", 1)
                self._dispatch(json.loads(raw))

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message:
            with self._condition:
                self._replies[message["id"]] = message
                self._condition.notify_all()
            return
        page = self._pages.get(message.get("sessionId", ""))
        if page is None:
            return
        params = message.get("params", {})
        method = message.get("method")
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
            page.console.append(ConsoleEntry(params.get("type", "log"), text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            page.console.append(ConsoleEntry("exception", details.get("exception", {}).get("description")
                                             or details.get("text", "")))
        elif method == "Log.entryAdded":  # failed loads, CSP violations and other browser-side messages
            entry = params.get("entry", {})
            text = f"{entry.get('text')} ({entry.get('url', '')})"
            page.console.append(ConsoleEntry(entry.get("level", "info"), text))

    def call(self, method: str, params: dict[str, Any] | None = None, session_id: str | None = None,
             timeout_s: float = 30.0) -> dict[str, Any]:
        with self._condition:
            self._next_id += 1
            message_id = self._next_id
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session_id is not None:
            message["sessionId"] = session_id
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        with self._condition:
            while message_id not in self._replies:
                if -1 in self._replies:
                    raise RuntimeError(f"{method}: {self._replies[-1]['error']['message']}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{method}: no reply in {timeout_s} s")
                self._condition.wait(remaining)
            reply = self._replies.pop(message_id)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})

    def new_page(self) -> Page:
        target_id = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session_id = self.call("Target.attachToTarget", {"targetId": target_id, "flatten": True})["sessionId"]
        page = Page(self, session_id)
        self.targets[session_id] = target_id
        self._pages[session_id] = page
        for domain in ("Runtime", "Log", "Page"):
            page.call(f"{domain}.enable")
        page.call("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 1600, "deviceScaleFactor": 1,
                                                          "mobile": False})
        return page

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout_s=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium binary (chromium, chromium-browser, google-chrome) on PATH: "
                    "apt-get install -y chromium to run the dashboard's browser tests")
    chromium = Chromium(binary, tmp_path_factory.mktemp("chromium") / "chromium.log")
    try:
        yield chromium
    finally:
        chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dashboard-screenshots")


SHOWS_LIVE = "document.getElementById('status').className.includes('ok')"
HIT_RATE_SHOWN = ("[...document.querySelectorAll('[data-role=hit-rate]')].some(e => /\\d%$/.test(e.textContent))"
                  " && document.querySelectorAll('.main-svg').length >= 3")


def open_page(browser: Chromium, url: str) -> Page:
    page = browser.new_page()
    page.open(url)
    return page


def test_page_without_a_key_asks_for_one(browser: Chromium, server: RunningServer, shots: Path) -> None:
    page = open_page(browser, f"{server.base_url}/dashboard")
    try:
        page.wait_for("!document.getElementById('notice').hidden", "the key notice")
        assert "needs an API key" in page.evaluate("document.getElementById('notice').textContent")
        assert SECRET_A not in page.text()
        page.screenshot(shots / "dashboard-no-key.png")
        assert not page.errors(), page.errors()
    finally:
        page.close()


def test_tenant_page_shows_its_hit_rate_and_tree_and_nothing_of_another(browser: Chromium, server: RunningServer,
                                                                        shots: Path) -> None:
    wait_for_samples(server.base_url, KEY_A)
    page = open_page(browser, f"{server.base_url}/dashboard#key={KEY_A}")
    try:
        page.wait_for(HIT_RATE_SHOWN, "the hit rate and its charts")
        page.wait_for(f"document.body.innerText.includes({json.dumps(SECRET_A)})", "tenant A's prompt text")
        assert KEY_A not in page.evaluate("location.href")  # the key left the address bar
        page.screenshot(shots / "dashboard-tenant-a.png")
        assert not page.errors(), page.errors()
    finally:
        page.close()

    page = open_page(browser, f"{server.base_url}/dashboard#key={KEY_B}")
    try:
        page.wait_for(HIT_RATE_SHOWN + " && " + SHOWS_LIVE, "tenant B's dashboard")
        page.wait_for("document.body.innerText.includes('Northwind')", "tenant B's own prompt text")
        assert SECRET_A not in page.text()
        page.screenshot(shots / "dashboard-tenant-b.png")
        assert not page.errors(), page.errors()
    finally:
        page.close()


def test_admin_page_sees_every_tenant(browser: Chromium, server: RunningServer, shots: Path) -> None:
    page = open_page(browser, f"{server.base_url}/dashboard#key={ADMIN_KEY}")
    try:
        page.wait_for(HIT_RATE_SHOWN, "the admin's dashboard")
        page.wait_for(f"document.body.innerText.includes({json.dumps(SECRET_A)})", "tenant A's prompt text")
        page.wait_for("document.body.innerText.includes('Northwind')", "tenant B's prompt text")
        assert "all tenants" in page.evaluate("document.getElementById('where').textContent")
        page.screenshot(shots / "dashboard-admin.png")
        assert not page.errors(), page.errors()
    finally:
        page.close()


def test_router_page_shows_backends_and_a_down_one(browser: Chromium, router: str, server: RunningServer,
                                                    shots: Path) -> None:
    page = open_page(browser, f"{router}/dashboard#key={KEY_A}")
    try:
        page.wait_for(HIT_RATE_SHOWN, "the live backend's dashboard")
        page.wait_for("[...document.querySelectorAll('[data-role=down]')].some(e => !e.hidden && "
                      "e.textContent.startsWith('down'))", "the down backend")
        assert server.base_url in page.evaluate("document.body.innerText")
        page.screenshot(shots / "dashboard-router.png")
        assert not page.errors(), page.errors()
    finally:
        page.close()
