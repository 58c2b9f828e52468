"""The chat page of ``edge-spec serve`` (``GET /``) and the per-token provenance it shows.

In process (Starlette's TestClient): the page and its files are served with a strict content policy, the
page's own requests pass the guard while a cross-site page's are refused, and ``x_edge_spec.provenance``
gives every streamed chunk its tokens' sources.  In a real browser (headless Chromium through selenium,
marked slow): a question streams into a Markdown answer with coloured tokens and the τ and tok/s status
line, the stop button ends a long answer and the server goes idle, settings survive a reload, a server
with an API key gets it from the page's dialog, and a page of another origin is refused.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from starlette.testclient import TestClient  # noqa: E402

from edge_spec.runtime.engine import Engine  # noqa: E402
from edge_spec.runtime.loops.config import loop_config  # noqa: E402
from edge_spec.server.serve import build_app  # noqa: E402
from tests.helpers import LiveServer  # noqa: E402

BASE = "http://127.0.0.1:8000"
EVIL = "http://evil.example"
STATIC = Path(__file__).parent.parent / "edge_spec" / "server" / "static"
SOURCES = {"target", "model", "lookup", "suffix", "forced", "guess", "eagle"}
PROMPT = "hello world"  # the tiny drafter has some of its drafts accepted here


def drafting_engine(bundle) -> Engine:
    """The drafter model drafts every round (the adaptive schedule soon stops asking the tiny drafter)."""
    config = loop_config("spec", gamma=4, schedule="fixed", suffix=False)  # the same prompt is asked again and again:
    return Engine.from_bundle(bundle, threads=1, config=config)  # a suffix cache would copy its earlier answer


@pytest.fixture(scope="module")
def engine(int4_bundle):
    return drafting_engine(int4_bundle)


def in_process(engine, **options):
    app, state = build_app(engine, name="tiny", **options)
    return TestClient(app, base_url=BASE), state


def chat_body(**extra):
    return {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0, "max_tokens": 60, **extra}


def stream_chunks(response) -> list[dict]:
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# -- the page's files ------------------------------------------------------------------------------


def test_page_and_its_files_are_served_same_origin_with_a_strict_policy(engine):
    client, _ = in_process(engine, api_key="secret")
    with client:
        page = client.get("/")
        html = page.text
        files = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
        served = {path: client.get(path) for path in files}
        module_imports, modules = [], ["/static/app.js"]
        while modules:  # the modules app.js imports, and theirs
            for name in re.findall(r'from "\./([^"]+)"', served[modules.pop()].text):
                module_imports.append(name)
                modules.append(f"/static/{name}")
                served[f"/static/{name}"] = client.get(f"/static/{name}")
        missing = client.get("/static/nothing.js")
        hidden = client.get("/static/.hidden.js")
        no_suffix = client.get("/static/LICENSE")
        models = client.get("/v1/models")  # the API still needs the key; the page does not
        cross_site = client.get("/", headers={"Origin": EVIL})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    for rule in ("default-src 'none'", "script-src 'self'", "connect-src 'self'", "frame-ancestors 'none'"):
        assert rule in policy
    assert "<script>" not in html and " style=" not in html  # nothing inline: the policy allows none
    assert "http://" not in html and "https://" not in html  # nothing from elsewhere (works offline)
    assert set(files) == {"/static/style.css", "/static/app.js", "/static/favicon.svg"}
    assert module_imports == ["markdown.js", "highlight.js"]
    assert re.search(r'<link rel="icon"[^>]* href="/static/favicon.svg"', html)  # no request for /favicon.ico
    for path, response in served.items():
        assert response.status_code == 200, path
        assert response.headers["x-content-type-options"] == "nosniff"
        assert response.text == (STATIC / path.rsplit("/", 1)[1]).read_text()
    assert served["/static/app.js"].headers["content-type"].startswith("text/javascript")
    assert served["/static/style.css"].headers["content-type"].startswith("text/css")
    assert served["/static/favicon.svg"].headers["content-type"] == "image/svg+xml"
    assert missing.status_code == hidden.status_code == no_suffix.status_code == 404
    assert models.status_code == 401
    assert cross_site.status_code == 403


def test_the_page_s_request_passes_the_guard_and_a_cross_site_one_does_not(engine):
    """What app.js sends: a JSON POST with the page's own origin; the same from another site is refused
    before anything runs, and so is its preflight."""
    client, state = in_process(engine)
    body = chat_body(stream=True, x_edge_spec={"provenance": True})
    with client:
        own = client.post("/v1/chat/completions", json=body, headers={"Origin": BASE})
        localhost = TestClient(client.app, base_url="http://localhost:8000")
        own_name = localhost.post("/v1/chat/completions", json=body, headers={"Origin": "http://localhost:8000"})
        evil = client.post("/v1/chat/completions", json=body, headers={"Origin": EVIL})
        other_port = client.post("/v1/chat/completions", json=body, headers={"Origin": "http://127.0.0.1:8001"})
        preflight = client.options(
            "/v1/chat/completions",
            headers={
                "Origin": EVIL,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
        )
        answered = dict(state.worker.counts)
    assert stream_chunks(own) and stream_chunks(own_name)
    for refused in (evil, other_port, preflight):
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in refused.headers
    assert answered.get("completed") == 2  # the refused requests never reached the engine


# -- provenance over HTTP --------------------------------------------------------------------------


def test_streamed_chunks_carry_their_tokens_sources(engine):
    client, _ = in_process(engine)
    with client:
        plain = stream_chunks(client.post("/v1/chat/completions", json=chat_body(stream=True)))
        sourced = stream_chunks(
            client.post("/v1/chat/completions", json=chat_body(stream=True, x_edge_spec={"provenance": True}))
        )
        full = client.post("/v1/chat/completions", json=chat_body(x_edge_spec={"provenance": True})).json()
        refused = [
            client.post("/v1/chat/completions", json=chat_body(x_edge_spec=value))
            for value in ({"provenance": "yes"}, {"colours": True}, [True])
        ]

    def content(chunks):
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

    assert content(sourced) == content(plain) == full["choices"][0]["message"]["content"]  # the same answer
    assert all("provenance" not in c.get("x_edge_spec", {}) for c in plain)  # only when asked for
    pieces = []
    for chunk in sourced[1:-1]:  # between the role chunk and the last one (finish reason, statistics)
        text = chunk["choices"][0]["delta"]["content"]
        provenance = chunk["x_edge_spec"]["provenance"]
        assert "".join(piece for piece, _ in provenance) == text
        pieces += provenance
    stats = sourced[-1]["x_edge_spec"]
    assert stats["stop_reason"] == "length" and "provenance" not in stats
    counts = collections.Counter(source for _, source in pieces)
    assert set(counts) <= SOURCES and counts["model"] > 0
    assert sum(counts.values()) == stats["new_tokens"]
    assert stats["new_tokens"] - counts["target"] == stats["accepted"]  # every accepted draft, named
    assert counts["target"] == stats["target_calls"] + 1  # a correction or bonus per pass, and the first token
    assert full["x_edge_spec"]["provenance"] == pieces  # the same answer, unstreamed: the same sources
    for response in refused:
        assert response.status_code == 400 and response.json()["error"]["param"].startswith("x_edge_spec")


def test_ar_mode_tokens_are_the_target_s(int4_bundle):
    engine = Engine.from_bundle(int4_bundle, mode="ar", threads=1)
    client, _ = in_process(engine)
    with client:
        chunks = stream_chunks(
            client.post("/v1/chat/completions", json=chat_body(stream=True, x_edge_spec={"provenance": True}))
        )
    sources = [s for c in chunks if "provenance" in c.get("x_edge_spec", {}) for _, s in c["x_edge_spec"]["provenance"]]
    assert len(sources) == chunks[-1]["x_edge_spec"]["new_tokens"] and set(sources) == {"target"}


# -- in a real browser -----------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def _browser_missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not (os.path.exists(path) or shutil.which(Path(path).name)):
            return f"{path} is missing (apt-get install chromium chromium-driver)"
    return None


browser_test = pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")


class Slowed:
    """The engine with a pause after each text chunk while ``delay`` is set (a long answer to stop)."""

    def __init__(self, engine: Engine) -> None:
        self.delay = 0.0
        generate = engine.generate

        def slowed(*args, **kwargs):
            for chunk in generate(*args, **kwargs):
                if self.delay:
                    time.sleep(self.delay)
                yield chunk

        engine.generate = slowed


@pytest.fixture(scope="module")
def slowed_engine(int4_bundle):
    engine = drafting_engine(int4_bundle)
    engine.slowed = Slowed(engine)
    return engine


@pytest.fixture
def browser(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console: failed loads (a 404) show there
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def wait(driver, condition, timeout: float = 60, what: str = "the page"):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: condition(d), f"timed out waiting for {what}"
    )


def text_of(driver, element_id: str) -> str:
    return driver.find_element("id", element_id).text


def send(driver, prompt: str) -> None:
    box = driver.find_element("id", "prompt")
    box.clear()
    box.send_keys(prompt)
    driver.find_element("id", "send").click()


@contextlib.contextmanager
def served_page(engine, driver, **options):
    """Serves ``engine`` as ``edge-spec serve`` would (``build_app`` with ``options``) on a live server and
    opens its chat page in ``driver``; yields the server and the app's state, and stops the server after."""
    app, state = build_app(engine, **options)
    server = LiveServer(app)
    try:
        driver.get(server.url + "/")
        yield server, state
    finally:
        server.stop()


def wait_ready(driver, what: str = "the page") -> None:
    """Waits for the page to have its model and settings loaded (``<body data-ready="true">``)."""
    wait(driver, lambda d: d.find_element("tag name", "body").get_attribute("data-ready") == "true", what=what)


def set_settings(driver, **values: str) -> None:
    """Types each value into its box of the settings dialog (``max_tokens`` is the ``max-tokens`` box), in
    order, and closes the dialog."""
    driver.find_element("id", "settings-button").click()
    for field, value in values.items():
        box = driver.find_element("id", field.replace("_", "-"))
        box.clear()
        box.send_keys(value)
    driver.find_element("id", "settings-close").click()


def ask(driver, prompt: str) -> None:
    """Sends ``prompt`` and waits for its answer to end, done or stopped at the token limit."""
    send(driver, prompt)
    wait(driver, lambda d: text_of(d, "stat-state") in ("done", "stopped at max tokens"), what="the answer")


def save_artifact(driver, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    assert driver.save_screenshot(str(shot))
    if os.environ.get("EDGE_SPEC_ARTIFACTS"):
        target = Path(os.environ["EDGE_SPEC_ARTIFACTS"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, target / name)
    return shot


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


@pytest.mark.slow
@browser_test
def test_chat_page_in_a_browser(slowed_engine, browser, tmp_path):
    driver = browser
    try:
        with served_page(slowed_engine, driver, name="tiny") as (server, _):
            wait_ready(driver, what="the page to start")
            assert text_of(driver, "model-name") == "tiny" and text_of(driver, "model-mode") == "spec"
            legend = driver.find_element("class name", "legend").text
            for label in ("drafter model", "copied", "grammar", "free guess", "target"):
                assert label in legend

            # settings: greedy, a short answer; kept in localStorage
            set_settings(driver, temperature="0", max_tokens="48")

            # a question: the answer streams in, coloured by source, with τ and tok/s
            ask(driver, PROMPT)
            answer = driver.find_element("css selector", ".msg.assistant .body")
            assert answer.text.strip()
            tokens = driver.find_elements("css selector", ".msg.assistant .body .tok")
            sources = collections.Counter(t.get_attribute("data-src") for t in tokens)
            assert set(sources) <= SOURCES and sources["target"] > 0 and sources["model"] > 0
            assert all(
                f"src-{source}" in t.get_attribute("class")
                for t in tokens[:20]
                for source in [t.get_attribute("data-src")]
            )
            colours = {
                driver.execute_script("return getComputedStyle(arguments[0]).backgroundColor", t) for t in tokens
            }
            assert len(colours) >= 2  # drafted and target tokens look different
            assert re.fullmatch(r"τ \d+\.\d\d", text_of(driver, "stat-tau"))
            assert float(text_of(driver, "stat-tau")[2:]) >= 1.0
            assert re.fullmatch(r"\d+\.\d tok/s", text_of(driver, "stat-tps"))
            assert text_of(driver, "stat-tokens") == "48 tokens"
            save_artifact(driver, tmp_path, "chat-page.png")

            # a long answer, stopped: the stream closes, the server cancels it and goes idle
            set_settings(driver, max_tokens="100000")
            slowed_engine.slowed.delay = 0.15
            send(driver, "tell me a long story about the cat and the mat")
            wait(
                driver,
                lambda d: (
                    len(d.find_elements("css selector", ".msg.assistant")) == 2
                    and len(d.find_elements("css selector", ".msg.assistant:last-child .tok")) >= 3
                ),
                what="the long answer",
            )
            assert health(server.url)["busy"]
            driver.find_element("id", "stop").click()
            wait(driver, lambda d: text_of(d, "stat-state") == "stopped", what="the stop")
            shown = len(driver.find_elements("css selector", ".msg.assistant:last-child .tok"))
            deadline = time.monotonic() + 20
            while health(server.url)["busy"]:
                assert time.monotonic() < deadline, "the server kept answering after the stop"
                time.sleep(0.05)
            after = health(server.url)
            assert after["busy"] is False and after["waiting"] == 0 and after["requests"].get("cancelled") == 1
            time.sleep(0.5)
            assert len(driver.find_elements("css selector", ".msg.assistant:last-child .tok")) == shown < 200
            assert driver.find_element("id", "send").is_enabled() and not driver.find_element("id", "stop").is_enabled()
            save_artifact(driver, tmp_path, "chat-page-stopped.png")

            # settings survive a reload
            slowed_engine.slowed.delay = 0.0
            driver.refresh()
            wait_ready(driver)
            assert driver.find_element("id", "max-tokens").get_attribute("value") == "100000"
    finally:
        slowed_engine.slowed.delay = 0.0


@pytest.mark.slow
@browser_test
def test_chat_page_asks_for_the_api_key_and_refuses_other_origins(slowed_engine, browser, tmp_path):
    driver = browser
    with served_page(slowed_engine, driver, name="tiny", api_key="page-key") as (server, state):
        dialog = driver.find_element("id", "key-dialog")
        wait(driver, lambda d: dialog.is_displayed(), what="the key dialog")
        driver.find_element("id", "api-key").send_keys("wrong")
        driver.find_element("id", "key-save").click()
        wait(driver, lambda d: "refused" in text_of(d, "key-error"), what="the refusal of a wrong key")
        driver.find_element("id", "api-key").send_keys("page-key")
        driver.find_element("id", "key-save").click()
        wait_ready(driver)
        assert driver.execute_script("return sessionStorage.getItem('edge-spec-api-key')") == "page-key"
        set_settings(driver, max_tokens="12")
        ask(driver, PROMPT)
        assert text_of(driver, "stat-tokens") == "12 tokens"
        assert state.worker.counts["completed"] == 1

        # a page of another origin (localhost is not 127.0.0.1 to a browser) cannot use the API
        driver.get(f"http://localhost:{server.port}/")
        outcome = driver.execute_async_script(
            """
            const done = arguments[arguments.length - 1];
            fetch(arguments[0] + "/v1/chat/completions", {method: "POST",
                  headers: {"Content-Type": "application/json", "Authorization": "Bearer page-key"},
                  body: JSON.stringify({messages: [{role: "user", content: "hi"}], max_tokens: 2})})
              .then(r => done("answered " + r.status), e => done("refused " + e.name));
        """,
            server.url,
        )
        assert outcome == "refused TypeError"  # the preflight got 403: the browser never sent the POST
        assert state.worker.counts["completed"] == 1


MARKDOWN = """# Primes
Use `is_prime(n)` with **care** and *thought*; snake_case_names stay as they are.

1. Check small numbers:
   ```python
   if n < 2:
       return False
   ```
2. Then the rest
   - nested item with [docs](https://docs.python.org/3/)

<script>alert(1)</script> <img src=x onerror=alert(1)> [bad](javascript:alert(1))

> a quote
---
```js
unfinished("fence"
"""


@pytest.mark.slow
@browser_test
def test_markdown_renderer_builds_safe_dom(slowed_engine, browser):
    """The page's renderer on a typical answer with hostile bits: structure as Markdown, every hostile
    string as plain text, and each token's characters wrapped in its source's class."""
    driver = browser
    with served_page(slowed_engine, driver, name="tiny") as (server, _):
        wait_ready(driver)
        result = driver.execute_async_script(
            """
            const [text, done] = [arguments[0], arguments[arguments.length - 1]];
            import("/static/markdown.js").then(({renderMarkdown}) => {
              const tokens = [];  // one token per 7 characters, sources alternating
              for (let i = 0; i < text.length; i += 7)
                tokens.push({start: i, end: Math.min(i + 7, text.length), source: i % 14 ? "model" : "target"});
              const plain = document.createElement("div");
              plain.append(renderMarkdown(text));
              const painted = document.createElement("div");
              painted.append(renderMarkdown(text, tokens));
              const q = (root, css) => [...root.querySelectorAll(css)];
              done({
                html: plain.innerHTML, text: plain.textContent,
                h1: q(plain, "h1").map(e => e.textContent),
                code: q(plain, "p code").map(e => e.textContent),
                strong: q(plain, "strong").map(e => e.textContent), em: q(plain, "em").map(e => e.textContent),
                ol: q(plain, "ol > li").length, nestedUl: q(plain, "ol li ul > li").length,
                blocks: q(plain, ".code-block").map(b => [b.querySelector(".code-lang").textContent,
                                                          b.querySelector("code").textContent]),
                blockInItem: q(plain, "ol li .code-block").length,
                links: q(plain, "a").map(a => [a.textContent, a.getAttribute("href"), a.rel, a.target]),
                elements: [...new Set(q(plain, "*").map(e => e.tagName.toLowerCase()))].sort(),
                quote: q(plain, "blockquote").map(e => e.textContent), rules: q(plain, "hr").length,
                paintedText: painted.textContent,
                sourceText: (() => {  // the text that came from the answer: no code labels or buttons
                  const copy = painted.cloneNode(true);
                  copy.querySelectorAll(".code-head").forEach(h => h.remove());
                  return copy.textContent;
                })(),
                spans: q(painted, "span.tok").map(s => [s.className, s.dataset.src, s.textContent]),
              });
            }, e => done({error: String(e)}));
        """,
            MARKDOWN,
        )
    assert "error" not in result, result
    assert result["h1"] == ["Primes"]
    assert result["code"] == ["is_prime(n)"] and result["strong"] == ["care"] and result["em"] == ["thought"]
    assert "snake_case_names" in result["text"]
    assert result["ol"] == 2 and result["nestedUl"] == 1 and result["blockInItem"] == 1
    assert result["blocks"] == [["python", "if n < 2:\n    return False"], ["js", 'unfinished("fence"']]
    assert result["links"] == [["docs", "https://docs.python.org/3/", "noopener noreferrer", "_blank"]]
    assert result["quote"] == ["a quote"] and result["rules"] == 1
    # hostile text stays text: no element beyond the renderer's own, no handler, no script URL
    assert set(result["elements"]) <= {
        "h1",
        "p",
        "code",
        "strong",
        "em",
        "ol",
        "ul",
        "li",
        "div",
        "span",
        "pre",
        "button",
        "a",
        "blockquote",
        "hr",
        "br",
    }
    assert "<script>alert(1)</script> <img src=x onerror=alert(1)> [bad](javascript:alert(1))" in result["text"]
    assert "onerror=" not in result["html"].replace("onerror=alert(1)&gt;", "")
    assert "javascript:" not in result["html"].replace("(javascript:alert(1))", "")
    # painting by source keeps the text and wraps every visible character in its token's class
    assert result["paintedText"] == result["text"]
    assert result["spans"] and all(cls == f"tok src-{src}" for cls, src, _ in result["spans"])
    assert {src for _, src, _ in result["spans"]} == {"model", "target"}
    painted = "".join(text for _, _, text in result["spans"])
    assert painted == result["sourceText"].replace("\n", "")  # all but the code blocks' line breaks


# -- a scripted answer: code highlighted under the sources' colours, on a desktop and on a phone ----------

CODE_ANSWER = '''Here is a function that checks whether a number is prime:

```python
def is_prime(n: int) -> bool:
    """Return True when n is a prime number."""
    if n < 2:
        return False
    for d in range(2, int(n ** 0.5) + 1):
        if n % d == 0:  # a divisor: not prime
            return False
    return True


print([n for n in range(30) if is_prime(n)])
```

It tries every divisor up to the square root of `n`; `is_prime(29)` is `True`.
'''
CODE = CODE_ANSWER.split("```python\n")[1].split("\n```")[0]
ROUNDS = [0, 3, 2, 5, 1, 4, 0, 6, 2, 3, 7, 1]  # accepted drafts per round, each round ending in a target token
LONG_NAME = "qwen2.5-coder-1.5b-instruct-int4-trim-32768-specvocab-r192-k128-with-a-name-wider-than-a-phone"


def sourced(text: str) -> list[list[str]]:
    """``text`` cut into word-sized tokens with the sources a speculative answer gives them: rounds of
    drafter tokens closed by a target token; the last code line, a repeat of earlier text, copied; a
    guess here and there."""
    tokens = re.findall(r"\s+|\w+|[^\w\s]", text)
    copied = text.index("print(")
    pieces, position, draft, rounds = [], 0, 0, iter(ROUNDS * 100)
    budget = next(rounds)
    for token in tokens:
        if copied <= position < copied + 40:
            source = "suffix"
        elif draft < budget:
            source, draft = ("guess" if token == ":" else "model"), draft + 1
        else:
            source, draft, budget = "target", 0, next(rounds)
        pieces.append([token, source])
        position += len(token)
    return pieces


def scripted_stream(pieces: list[list[str]], tokens_per_second: float) -> str:
    """What ``/v1/chat/completions`` streams for an answer of ``pieces`` (server-sent events), a few
    tokens a chunk, then the statistics."""
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    for start in range(0, len(pieces), 4):
        part = pieces[start : start + 4]
        content = "".join(text for text, _ in part)
        chunks.append({"choices": [{"index": 0, "delta": {"content": content}}], "x_edge_spec": {"provenance": part}})
    targets = sum(source == "target" for _, source in pieces)
    chunks.append(
        {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "x_edge_spec": {
                "stop_reason": "stop",
                "new_tokens": len(pieces),
                "tau": (len(pieces) - 1) / max(targets - 1, 1),
                "tokens_per_second": tokens_per_second,
                "mode": "spec",
            },
        }
    )
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


def script_answer(driver, stream: str) -> None:
    """The page's next answers are ``stream``, not the model's (the page's own fetch of the completions
    endpoint answered in the browser; everything else reaches the server)."""
    driver.execute_script(
        """
        const [stream] = arguments;
        const real = window.fetch.bind(window);
        window.fetch = (url, init) => String(url).endsWith("/v1/chat/completions")
          ? Promise.resolve(new Response(stream, {status: 200, headers: {"Content-Type": "text/event-stream"}}))
          : real(url, init);
        """,
        stream,
    )


def failed_loads(driver) -> list[str]:
    return [entry["message"] for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]


@pytest.mark.slow
@browser_test
def test_code_is_highlighted_under_the_sources_colours_and_the_page_fits_a_phone(slowed_engine, browser, tmp_path):
    driver = browser
    with served_page(slowed_engine, driver, name=LONG_NAME) as (server, _):
        wait_ready(driver)
        icon = driver.execute_async_script(
            """
            const done = arguments[arguments.length - 1];
            fetch(document.querySelector("link[rel=icon]").href)
              .then(r => done(r.status + " " + r.headers.get("content-type")), e => done(String(e)));
            """
        )
        assert icon == "200 image/svg+xml"
        pieces = sourced(CODE_ANSWER)
        script_answer(driver, scripted_stream(pieces, 12.34))
        send(driver, "Write a function that checks whether a number is prime")
        wait(driver, lambda d: text_of(d, "stat-state") == "done", what="the scripted answer")
        found = driver.execute_script(
            """
            const block = document.querySelector(".msg.assistant .code-block");
            const style = (e) => getComputedStyle(e);
            const swatch = (source) => style(document.querySelector(".legend .swatch.src-" + source)).backgroundColor;
            const tokens = [...block.querySelectorAll(".tok")];
            return {
              code: block.querySelector("code").textContent,
              kinds: Object.fromEntries(["kw", "str", "com", "num", "fn", "lit", "bi"].map(kind =>
                [kind, [...block.querySelectorAll(".hl-" + kind)].map(e => e.textContent)])),
              colours: [...new Set([...block.querySelectorAll("code [class^=hl-]")].map(e => style(e).color))],
              plain: style(block.querySelector("code")).color,
              highlightedTokens: tokens.filter(t => t.closest("[class^=hl-]")).length,
              wrongBackground: tokens.filter(t => style(t).backgroundColor !== swatch(t.dataset.src === "suffix"
                ? "lookup" : t.dataset.src)).map(t => t.textContent),
              sources: [...new Set(tokens.map(t => t.dataset.src))].sort(),
              text: document.querySelector(".msg.assistant .body").textContent,
            };
            """
        )
        assert found["code"] == CODE  # the text as written, whatever spans it is cut into
        assert {"def", "if", "return", "for", "in"} <= set(found["kinds"]["kw"])
        assert '"""Return True when n is a prime number."""' in found["kinds"]["str"]
        assert found["kinds"]["com"] == ["# a divisor: not prime"]
        assert {"2", "0.5", "1", "0", "30"} <= set(found["kinds"]["num"])
        assert "is_prime" in found["kinds"]["fn"] and {"False", "True"} <= set(found["kinds"]["lit"])
        assert {"range", "int", "print"} <= set(found["kinds"]["bi"])
        assert len(found["colours"]) >= 5 and found["plain"] not in found["colours"]  # the text colours
        # and every token keeps its source's background, inside highlighted words too
        assert found["highlightedTokens"] > 20 and found["wrongBackground"] == []
        assert found["sources"] == ["guess", "model", "suffix", "target"]
        assert "is_prime(29)" in found["text"] and "```" not in found["text"]
        assert text_of(driver, "stat-tps") == "12.3 tok/s"
        assert failed_loads(driver) == []  # the favicon and every file of the page loaded
        save_artifact(driver, tmp_path, "chat-page-code.png")

        # on a phone: the header stays one line, the model's name cut short with an ellipsis
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride", {"width": 390, "height": 844, "deviceScaleFactor": 2, "mobile": True}
        )
        layout = driver.execute_script(
            """
            const rect = (e) => e.getBoundingClientRect();
            const name = document.getElementById("model-name");
            const line = parseFloat(getComputedStyle(name).lineHeight) || 1.3 * parseFloat(getComputedStyle(name).fontSize);
            return {
              width: document.documentElement.clientWidth, scrollWidth: document.documentElement.scrollWidth,
              header: rect(document.querySelector(".top")).height, nameHeight: rect(name).height, line,
              cut: name.scrollWidth > name.clientWidth, title: name.title,
              button: rect(document.getElementById("settings-button")).right,
              brand: rect(document.querySelector(".brand")).height,
            };
            """
        )
        assert layout["width"] == 390 and layout["scrollWidth"] <= 390, layout  # nothing wider than the screen
        assert layout["nameHeight"] <= 1.5 * layout["line"] and layout["cut"], layout  # one line, ellipsis
        assert layout["title"] == LONG_NAME  # the whole name on hover
        assert layout["header"] < 60 and layout["button"] <= 390, layout
        save_artifact(driver, tmp_path, "chat-page-phone.png")

        # the legend says what each colour means, repeats shown as the drafter's included
        driver.find_element("css selector", ".legend summary").click()
        legend = driver.find_element("class name", "legend").text
        for words in ("accepted by the target", "a grammar allowed", "the first token, a correction"):
            assert words in legend
        assert "Repeated text is not always" in legend and "the drafter model drafts it" in legend
        save_artifact(driver, tmp_path, "chat-page-legend-phone.png")


@pytest.mark.slow
@browser_test
def test_an_answer_of_one_token_shows_no_speed(slowed_engine, browser):
    """One token comes from the prompt's pass: there is no decode speed to show, not 0.0 tok/s."""
    driver = browser
    with served_page(slowed_engine, driver, name="tiny") as (server, _):
        wait_ready(driver)
        set_settings(driver, max_tokens="1")
        ask(driver, PROMPT)
        assert text_of(driver, "stat-tokens") == "1 tokens"
        assert text_of(driver, "stat-tps") == "– tok/s"
        assert "– tok/s" in driver.find_element("css selector", ".msg.assistant .foot").text
