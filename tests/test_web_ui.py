"""The chat page ``serve`` shows at ``/``: its HTTP side, and the page itself in a real browser.

The browser tests drive Debian's ``chromium`` with Playwright (Playwright's own browser download cannot
be reached here); they skip, saying why, where either is missing. ``.ci/run`` installs chromium.
The screenshot goes to ``$MLX_INFER_TEST_ARTIFACTS`` (default: pytest's tmp folder); the test prints it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import httpx
import pytest
from conftest import TINY_LLAMA_CONFIG, make_tiny_llama, write_hf_folder
from mlx.utils import tree_flatten
from server_helpers import LiveServer, kv_gib_for_blocks, wait_for_idle

CHROMIUM = Path(os.environ.get("MLX_INFER_CHROMIUM", "/usr/bin/chromium"))
API_KEY = "sesame-123"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    weights = dict(tree_flatten(make_tiny_llama(0).parameters()))
    return write_hf_folder(tmp_path_factory.mktemp("web") / "tiny-llama", weights, TINY_LLAMA_CONFIG)


@pytest.fixture(scope="module")
def keyed_server(tiny_folder: Path):
    server = LiveServer(tiny_folder, "--api-key", API_KEY, name="tiny", startup_timeout=120)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def smollm2_server(smollm2_path: Path):
    server = LiveServer(smollm2_path, "--max-num-seqs", "2", "--kv-memory", str(kv_gib_for_blocks(200)))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright; it is in the test extra)")
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set MLX_INFER_CHROMIUM)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield browser
        browser.close()


# ---- HTTP side -----------------------------------------------------------------------------------
def test_page_and_assets_are_served_unguarded_with_a_strict_policy(keyed_server: LiveServer):
    page = httpx.get(keyed_server.base_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy  # no inline or foreign script
    for name in ("chat.js", "render.js", "chat.css", "vendor/marked.umd.js", "vendor/purify.min.js"):
        asset = httpx.get(f"{keyed_server.base_url}/static/{name}", timeout=10)
        assert asset.status_code == 200, name
        assert f"static/{name}" in page.text  # the page loads it, from this server
    assert "http" not in page.text.replace("http-equiv", "")  # nothing fetched from elsewhere
    missing = httpx.get(keyed_server.base_url + "/static/nope.js", timeout=10)
    assert missing.status_code == 404 and "error" in missing.json()
    # The API stays guarded.
    assert httpx.get(keyed_server.base_url + "/v1/models", timeout=10).status_code == 401


def test_models_lists_context_length_and_quantization(keyed_server: LiveServer):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = httpx.get(keyed_server.base_url + "/v1/models", headers=headers, timeout=10).json()
    (model,) = body["data"]
    assert model["id"] == "tiny"
    assert model["context_length"] == TINY_LLAMA_CONFIG["max_position_embeddings"]
    assert model["architecture"] == "llama"
    assert model["quantization"] == "float32"  # the tiny folder's safetensors dtype


def test_no_web_turns_the_page_off(tiny_folder: Path):
    server = LiveServer(tiny_folder, "--no-web", name="tiny", startup_timeout=120)
    try:
        assert httpx.get(server.base_url + "/", timeout=10).status_code == 404
        assert httpx.get(server.base_url + "/static/chat.js", timeout=10).status_code == 404
        assert httpx.get(server.base_url + "/v1/models", timeout=10).status_code == 200
    finally:
        server.stop()


# ---- in a browser --------------------------------------------------------------------------------
def cached_tokens(stats_line: str) -> int:
    """The cached prompt tokens a message's stats line shows ("... 52 prompt tokens (48 cached) ...")."""
    match = re.search(r"\((\d+) cached\)", stats_line)
    assert match, stats_line
    return int(match.group(1))


def test_page_asks_for_the_api_key_and_escapes_what_it_renders(browser, keyed_server: LiveServer):
    page = browser.new_page()
    page.goto(keyed_server.base_url + "/")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#api-key", "wrong")
    page.click("#api-key-save")
    page.wait_for_function("() => document.getElementById('key-error').textContent.includes('refused')")
    page.fill("#api-key", API_KEY)
    page.click("#api-key-save")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
    assert page.is_hidden("#key-form")

    # A message goes through with the stored key, and comes back shown as text.
    page.click("#settings-toggle")
    page.fill("#max-tokens", "8")  # the tiny model's context is 256 tokens
    page.dispatch_event("#max-tokens", "change")
    page.fill("#prompt", "w1 w2 <b>w3</b>")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .stats:has-text('generated')", timeout=60_000)
    assert page.inner_text(".msg.user .content") == "w1 w2 <b>w3</b>"
    assert page.eval_on_selector(".msg.user .content", "e => e.querySelector('b')") is None

    # Model text is markdown, but nothing in it runs: handlers, scripts and javascript: links are removed.
    hostile = (
        '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
        "[link](javascript:window.__pwned=3) <svg onload=window.__pwned=4></svg>\n\n```python\nprint(1)\n```"
    )
    html = page.evaluate(
        "(text) => { const d = document.createElement('div'); document.body.append(d);"
        " renderMarkdown(d, text); d.querySelector('a')?.click(); return d.innerHTML }",
        hostile,
    )
    page.wait_for_timeout(300)
    assert page.evaluate("window.__pwned") is None
    # What is left of the hostile HTML is inert text: no element, handler attribute or script URL.
    assert "<script" not in html and "<img" not in html and "<svg" not in html and "javascript:" not in html
    handlers = page.evaluate(
        "(html) => { const d = document.createElement('div'); d.innerHTML = html;"
        " return [...d.querySelectorAll('*')].flatMap(e => [...e.attributes].map(a => a.name))"
        ".filter(name => name.startsWith('on')) }",
        html,
    )
    assert handlers == []
    assert "<pre>" in html and "print(1)" in html and 'class="copy"' in html  # code block with a copy button
    page.close()


def test_a_failed_turn_is_not_sent_again_and_page_fields_stay_the_pages(browser, keyed_server: LiveServer):
    page = browser.new_page()
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    sent = []
    page.on("request", lambda r: r.url.endswith("/completions") and sent.append(json.loads(r.post_data)))
    page.goto(keyed_server.base_url + "/")
    page.wait_for_selector("#key-form:not([hidden])")
    page.fill("#api-key", API_KEY)
    page.click("#api-key-save")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
    page.click("#settings-toggle")
    page.fill("#max-tokens", "4")
    page.dispatch_event("#max-tokens", "change")
    # Fields the page sets itself are its own: one streamed answer a turn, whatever the extra fields say.
    page.fill("#extra", json.dumps({"n": 2, "stream": False, "seed": 3}))
    page.dispatch_event("#extra", "change")
    assert page.inner_text("#extra-error") == "stream, n: set by the page, ignored"

    page.fill("#prompt", "w1 " * 400)  # beyond the tiny model's 256-token context
    page.click("#send")
    page.wait_for_selector(".msg.assistant .error:has-text('context')", timeout=60_000)
    page.fill("#prompt", "w1 w2")
    page.click("#send")
    page.wait_for_selector(".msg.assistant .stats:has-text('generated')", timeout=60_000)
    # The failed turn (its question and its empty answer) was not sent again.
    assert [(m["role"], m["content"]) for m in sent[-1]["messages"]] == [("user", "w1 w2")]
    assert (sent[-1]["n"], sent[-1]["stream"], sent[-1]["seed"]) == (1, True, 3)
    # The only console errors are the two refusals above (the key missing, the prompt too long): no
    # favicon 404, no script error.
    assert [e for e in errors if not re.search(r"status of (401|400)", e)] == [], errors
    page.close()


def test_chat_streams_stops_frees_blocks_and_survives_a_reload(browser, smollm2_server: LiveServer, tmp_path):
    server = smollm2_server
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    page.goto(server.base_url + "/")
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'smollm2'")
    page.click("#settings-toggle")
    page.fill("#max-tokens", "2000")
    page.dispatch_event("#max-tokens", "change")
    page.fill("#extra", json.dumps({"ignore_eos": True}))  # a long answer, whatever the model says
    page.dispatch_event("#extra", "change")

    page.fill("#prompt", "Count to one thousand.")
    page.press("#prompt", "Enter")
    answer = ".msg.assistant .content"
    page.wait_for_function(
        f"() => document.querySelector('{answer}')?.textContent.length > 0", timeout=60_000
    )
    first = len(page.inner_text(answer))
    page.wait_for_function(f"() => document.querySelector('{answer}').textContent.length > {first + 20}")
    running = server.metrics()
    assert running["mlx_infer_requests_running"] == 1 and running["mlx_infer_kv_blocks_used"] > 0
    assert page.is_visible("#stop") and page.is_hidden("#send")

    page.click("#stop")
    idle = wait_for_idle(server)
    assert idle["mlx_infer_requests_running"] == 0 and idle["mlx_infer_kv_blocks_used"] == 0
    page.wait_for_selector(".msg.assistant .stats:has-text('stopped')")
    stopped_text = page.inner_text(answer)
    assert page.is_visible("#send")

    # Edit and resend: the conversation is cut at the edited message; then regenerate the answer, whose
    # prompt now comes from the prefix cache (the stats show the cached tokens).
    page.fill("#extra", "")
    page.dispatch_event("#extra", "change")
    page.fill("#max-tokens", "8")
    page.dispatch_event("#max-tokens", "change")
    page.click(".msg.user .edit")
    page.fill(".msg.user .edit-box", "What is the capital of France? Answer in one word.")
    page.click(".msg.user .resend")
    stats = ".msg.assistant .stats"
    page.wait_for_selector(f"{stats}:has-text('generated')", timeout=60_000)
    assert page.locator(".msg").count() == 2
    edited_cached = cached_tokens(page.inner_text(stats))
    page.click(".msg.assistant .regenerate")
    page.wait_for_selector(f"{stats}:has-text('generated')", timeout=60_000)
    line = page.inner_text(stats)
    assert cached_tokens(line) > 0 and cached_tokens(line) >= edited_cached, line
    assert "TTFT" in line and "tok/s" in line and "prompt tokens" in line, line
    final_answer = page.inner_text(answer)
    assert final_answer and final_answer != stopped_text

    # Reload: the conversation comes back from local storage.
    page.reload()
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'smollm2'")
    # Editing the first message retitles the conversation after it.
    assert page.inner_text("#conversations li.current .open").startswith("What is the capital of France?")
    assert page.inner_text(".msg.user .content") == "What is the capital of France? Answer in one word."
    assert page.inner_text(answer) == final_answer

    folder = Path(os.environ.get("MLX_INFER_TEST_ARTIFACTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    shot = folder / "web_ui.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot of the chat page: {shot}")
    assert shot.stat().st_size > 10_000

    # A reload mid-answer: the browser cuts the request (the server frees its blocks), and the answer so
    # far comes back marked interrupted, not as a lost connection.
    page.click("#settings-toggle")
    page.fill("#max-tokens", "2000")
    page.dispatch_event("#max-tokens", "change")
    page.fill("#extra", json.dumps({"ignore_eos": True}))
    page.dispatch_event("#extra", "change")
    page.fill("#prompt", "Count to one thousand.")
    page.press("#prompt", "Enter")
    last = ".msg.assistant >> nth=1"
    page.wait_for_function(
        "() => document.querySelectorAll('.msg.assistant')[1]?.textContent.length > 100", timeout=60_000
    )
    shown = page.inner_text(f"{last} >> .content")
    page.reload()
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'smollm2'")
    assert page.inner_text(f"{last} >> .content").startswith(shown[:50])
    assert "interrupted" in page.inner_text(f"{last} >> .stats")
    assert page.locator(f"{last} >> .error").count() == 0
    assert wait_for_idle(server)["mlx_infer_kv_blocks_used"] == 0
    page.close()


def test_page_picks_among_several_models_and_leaves_out_embedding_ones(
    browser, tiny_folder: Path, smollm2_path: Path, tmp_path
):
    embedder = Path(os.environ.get("MLX_INFER_TEST_EMBEDDING_MODEL", ""))
    if not (embedder / "config.json").is_file():
        pytest.skip("no embedding model (make embedding-model; MLX_INFER_TEST_EMBEDDING_MODEL)")
    server = LiveServer([smollm2_path, tiny_folder, embedder], "--kv-memory", "0.2", name=None)
    try:
        page = browser.new_page()
        page.goto(server.base_url + "/")
        page.wait_for_selector("#model-select:not([hidden])")
        options = page.eval_on_selector_all("#model-select option", "os => os.map(o => o.value)")
        assert options == [smollm2_path.stem, "tiny-llama"]  # the embedding model cannot chat
        assert "loaded on first message" in page.inner_text("#model-info")
        page.select_option("#model-select", "tiny-llama")
        page.click("#settings-toggle")
        page.fill("#max-tokens", "6")  # the tiny model's context is 256 tokens
        page.dispatch_event("#max-tokens", "change")
        page.fill("#prompt", "w1 w2")
        page.click("#send")
        page.wait_for_selector(".msg.assistant .stats:has-text('generated')", timeout=60_000)
        states = httpx.get(server.base_url + "/health", timeout=10).json()["models"]
        assert states["tiny-llama"] == "loaded" and states[smollm2_path.stem] == "not-loaded"
        page.reload()  # the choice is remembered
        page.wait_for_function("() => document.getElementById('model-select').value === 'tiny-llama'")
        page.close()
    finally:
        server.stop()


def _canned_stream(reasoning: list[str], content: list[str]) -> str:
    """An SSE answer as the chat route streams it, thinking (reasoning_content) first."""
    chunks = [{"role": "assistant", "content": ""}]
    chunks += [{"reasoning_content": r} for r in reasoning] + [{"content": c} for c in content]
    events = [{"choices": [{"index": 0, "delta": d, "finish_reason": None}]} for d in chunks]
    events.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": 9, "completion_tokens": len(reasoning) + len(content), "total_tokens": 0}
    events.append({"choices": [], "usage": usage})
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def test_page_shows_thinking_and_html_as_text_and_tabs_keep_each_others_chats(
    browser, keyed_server: LiveServer
):
    context = browser.new_context()
    # Answers come canned (what a server with --reasoning-parser streams), so this tests the page alone.
    answer = _canned_stream(["Let me ", "think."], ["Use `vector<int>` or ", "List<String>; x<y and y>z."])
    context.route(
        "**/v1/chat/completions",
        lambda route: route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=answer),
    )
    a = context.new_page()
    a.goto(keyed_server.base_url + "/")
    a.wait_for_selector("#key-form:not([hidden])")
    a.fill("#api-key", API_KEY)
    a.click("#api-key-save")
    a.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")

    b = context.new_page()  # a second tab, opened before the first one's chat exists
    b.goto(keyed_server.base_url + "/")
    b.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
    for page, text in ((b, "the chat of tab b"), (a, "the chat of tab a")):
        page.fill("#prompt", text)
        page.click("#send")
        page.wait_for_selector(".msg.assistant .stats:has-text('generated')")
    # Thinking shown apart, above the answer; HTML-like text in the answer shown as written.
    assert a.inner_text(".msg.assistant .reasoning") == "Let me think."
    assert a.inner_text(".msg.assistant .content") == "Use vector<int> or List<String>; x<y and y>z."
    shown = a.evaluate(
        "() => { const d = document.createElement('div'); renderMarkdown(d, 'The <div> tag and <b>bold</b>');"
        " return [d.textContent.trim(), d.querySelector('b') === null] }"
    )
    assert shown == ["The <div> tag and <b>bold</b>", True]
    block = a.evaluate(
        "() => { const m = document.createElement('div'); m.className = 'msg'; document.body.append(m);"
        " const d = document.createElement('div'); d.className = 'content'; m.append(d);"
        " renderMarkdown(d, '<div>\\n<b>x</b>\\n</div>\\n\\nafter'); return d.innerText }"
    )
    assert block.startswith("<div>\n<b>x</b>\n</div>")  # an HTML block keeps its lines

    # Neither tab wrote over the other's conversation: a third tab has both, and so has the first.
    c = context.new_page()
    c.goto(keyed_server.base_url + "/")
    titles = c.eval_on_selector_all("#conversations .open", "bs => bs.map(b => b.textContent)")
    assert sorted(titles) == ["the chat of tab a", "the chat of tab b"]
    a.wait_for_function("() => document.querySelectorAll('#conversations .open').length === 2")
    # Another tab's save leaves an edit being typed here alone.
    a.click(".msg.user .edit")
    a.fill(".msg.user .edit-box", "half-typed")
    b.click("#new-chat")
    a.wait_for_function("() => document.querySelectorAll('#conversations .open').length === 3")
    assert a.input_value(".msg.user .edit-box") == "half-typed"
    a.click(".msg.user .cancel")

    # Storage full: the turn goes on from memory, and the page says it is not saved.
    a.evaluate(
        "() => { let i = 0; for (let size = 1 << 20; size >= 1; size >>= 1) for (;;) {"
        " try { localStorage.setItem('filler' + i++, 'x'.repeat(size)) } catch (e) { break } } }"
    )
    a.fill("#prompt", "one more")
    a.click("#send")
    a.wait_for_selector(".msg.assistant:nth-of-type(4) .stats:has-text('generated')")
    assert "storage is full" in a.inner_text("#storage-error")
    a.evaluate("() => Object.keys(localStorage).filter(k => k.startsWith('filler')).forEach(k => localStorage.removeItem(k))")  # noqa: E501

    # A phone's width: the page fits it, the message box usable.
    phone = context.new_page()
    phone.set_viewport_size({"width": 375, "height": 740})
    phone.goto(keyed_server.base_url + "/")
    phone.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
    assert phone.evaluate("() => document.documentElement.scrollWidth") <= 375
    assert phone.eval_on_selector("#prompt", "e => e.getBoundingClientRect().width") > 200
    phone.set_viewport_size({"width": 320, "height": 568})
    phone.click("#settings-toggle")  # the settings open, the message box stays on screen
    assert phone.evaluate("() => document.documentElement.scrollWidth") <= 320
    assert phone.eval_on_selector("#send", "e => e.getBoundingClientRect().bottom") <= 568
    context.close()


# ---- a server that comes and goes, answers that stream on (the page alone: canned or faked answers) ----
MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

# An answer that streams until stopped (a real model would finish, or lag, at unknown times): a word every
# 15 ms, a paragraph every five. `window.cutStreams()` breaks every stream as a lost connection does.
ENDLESS_ANSWER = """
(() => {
  const realFetch = (window.realFetch = window.fetch);
  const open = new Map(); // stream controller -> its timer
  const end = (controller, error) => {
    clearInterval(open.get(controller));
    open.delete(controller);
    controller.error(error);
  };
  window.cutStreams = () => [...open.keys()].forEach((c) => end(c, new TypeError("network error")));
  window.fetch = (url, options) => {
    if (!String(url).endsWith("chat/completions")) return realFetch(url, options);
    const encoder = new TextEncoder();
    const body = new ReadableStream({
      start(controller) {
        let i = 0;
        open.set(controller, setInterval(() => {
          i += 1;
          const delta = { content: "word" + i + (i % 5 ? " " : "\\n\\n") };
          const event = { choices: [{ index: 0, delta, finish_reason: null }] };
          controller.enqueue(encoder.encode("data: " + JSON.stringify(event) + "\\n\\n"));
        }, 15));
        const aborted = new DOMException("aborted", "AbortError");
        options.signal.addEventListener("abort", () => end(controller, aborted));
      },
    });
    return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
  };
})();
"""


def _routed_context(browser, server: LiveServer, **options):
    """A browser context whose /v1/models lists one model "tiny" (the page itself from ``server``);
    returns it and the bodies of the chat requests it sends, which get a canned answer "Hello."."""
    context = browser.new_context(**options)
    context.route("**/v1/models", lambda route: route.fulfill(status=200, body=MODELS))
    sent = []

    def answer(route):
        sent.append(json.loads(route.request.post_data))
        body = _canned_stream([], ["Hello."])
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"}, body=body)

    context.route("**/v1/chat/completions", answer)
    return context, sent


def _open(context, server: LiveServer, until: str = "textContent === 'tiny'"):
    """A page of ``context`` on the chat, once the header's model name satisfies ``until``."""
    page = context.new_page()
    page.goto(server.base_url + "/")
    page.wait_for_function(f"() => document.getElementById('model-name').{until}")
    return page


def _endless_page(browser, server: LiveServer, **options):
    """A page whose answers stream words until stopped or cut (ENDLESS_ANSWER); returns (context, page)."""
    context, _ = _routed_context(browser, server, **options)
    context.unroute("**/v1/chat/completions")
    context.add_init_script(ENDLESS_ANSWER)
    return context, _open(context, server)


def _wait_for_words(page, answer: int):
    """Until the answer ``answer`` (0 the first) has streamed a few words."""
    content = f"document.querySelectorAll('.msg.assistant')[{answer}].textContent"
    page.wait_for_function(f"() => {content}.includes('word3')")


def test_send_asks_again_for_a_server_that_was_unreachable(browser, keyed_server: LiveServer):
    context, sent = _routed_context(browser, keyed_server)
    reachable = False
    models = lambda route: route.fulfill(status=200, body=MODELS) if reachable else route.abort()  # noqa: E731
    context.route("**/v1/models", models)
    page = _open(context, keyed_server, until="textContent.includes('cannot reach')")

    # Still unreachable: the page says so, and the message stays in its box.
    page.fill("#prompt", "hello")
    page.click("#send")
    page.wait_for_selector("#send-error:has-text('Not sent: cannot reach the server')")
    assert page.input_value("#prompt") == "hello" and page.locator(".msg").count() == 0

    # Back: Send finds the model and sends.
    reachable = True
    page.click("#send")
    page.wait_for_selector(".msg.assistant .stats:has-text('generated')")
    assert page.inner_text(".msg.assistant .content") == "Hello."
    assert page.inner_text("#model-name") == "tiny" and page.inner_text("#send-error") == ""
    assert [m["content"] for m in sent[-1]["messages"]] == ["hello"]
    context.close()


def test_connection_errors_are_said_in_words(browser, keyed_server: LiveServer):
    context, page = _endless_page(browser, keyed_server)
    # A connection lost mid-answer keeps the answer so far, and says so (not the browser's "network error").
    page.fill("#prompt", "a story")
    page.press("#prompt", "Enter")
    _wait_for_words(page, 0)
    page.evaluate("window.cutStreams()")
    page.wait_for_selector(".msg.assistant .error")
    assert page.inner_text(".msg.assistant .error") == "lost connection to the server"
    assert "word3" in page.inner_text(".msg.assistant .content")
    # A request that cannot reach the server: not the browser's "Failed to fetch".
    context.route("**/v1/chat/completions", lambda route: route.abort())
    page.evaluate("window.fetch = window.realFetch")
    page.fill("#prompt", "again")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant >> nth=1 >> .error")
    assert page.inner_text(".msg.assistant >> nth=1 >> .error") == "cannot reach the server"
    context.close()


def test_the_keyboard_stays_in_the_message_box_after_send_and_stop(browser, keyed_server: LiveServer):
    context, page = _endless_page(browser, keyed_server)
    page.get_by_label("Message", exact=True).fill("a story")  # the box has a name
    page.click("#send")
    _wait_for_words(page, 0)
    assert page.evaluate("document.activeElement.id") == "prompt"
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .stats:has-text('stopped')")
    assert page.evaluate("document.activeElement.id") == "prompt"
    context.close()


def test_an_emptied_temperature_is_not_sent(browser, keyed_server: LiveServer):
    context, sent = _routed_context(browser, keyed_server)
    page = _open(context, keyed_server)
    page.click("#settings-toggle")
    # Emptied: the server's default, not 0.
    for turn, (value, expected) in enumerate((("", None), ("0.3", 0.3))):
        page.fill("#temperature", value)
        page.dispatch_event("#temperature", "change")
        page.fill("#prompt", "w1")
        page.click("#send")
        page.wait_for_selector(f".msg.assistant >> nth={turn} >> .stats:has-text('generated')")
        assert sent[-1].get("temperature") == expected and sent[-1]["max_tokens"] == 512
    context.close()


def test_titles_are_cut_between_characters(browser, keyed_server: LiveServer):
    context, _ = _routed_context(browser, keyed_server)
    page = _open(context, keyed_server)
    title = "a" + "\N{GRINNING FACE}" * 60  # 48 UTF-16 units would end in half an emoji
    page.fill("#prompt", title)
    page.click("#send")
    page.wait_for_selector(".msg.assistant .stats:has-text('generated')")
    assert page.inner_text("#conversations li.current .open") == title[:48]
    context.close()


def test_images_show_their_alt_text_and_forget_key_needs_a_key(browser, keyed_server: LiveServer):
    context, _ = _routed_context(browser, keyed_server)
    page = _open(context, keyed_server)
    # A markdown image shows its alt text, a link: nothing is loaded from elsewhere.
    image = page.evaluate(
        "() => { const d = document.createElement('div'); renderMarkdown(d, '![a cat](https://example.com/c.png)');"
        " const a = d.querySelector('a'); return [d.querySelector('img') === null, a?.textContent, a?.href] }"
    )
    assert image == [True, "a cat", "https://example.com/c.png"]
    # Forget API key only where there is a key to forget.
    page.click("#settings-toggle")
    assert page.is_hidden("#forget-key")
    page.evaluate("localStorage.setItem('mlx-infer.api-key', 'k')")
    page.reload()
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
    page.click("#settings-toggle")
    assert page.is_visible("#forget-key")
    context.close()


def test_an_answer_cut_by_a_reload_comes_back_marked_interrupted(browser, keyed_server: LiveServer):
    context, page = _endless_page(browser, keyed_server)
    page.fill("#prompt", "a long story")
    page.click("#send")
    page.wait_for_function("() => document.querySelector('.msg.assistant .content').textContent.length > 300")
    shown = page.inner_text(".msg.assistant .content")
    page.reload()
    page.wait_for_function("() => document.getElementById('model-name').textContent === 'tiny'")
    assert page.inner_text(".msg.assistant .content").startswith(shown[:200])
    assert "interrupted" in page.inner_text(".msg.assistant .stats")
    assert page.is_visible("#send") and page.is_hidden("#stop")
    context.close()


def test_the_view_follows_the_answer_only_from_the_end(browser, keyed_server: LiveServer):
    context, page = _endless_page(browser, keyed_server, viewport={"width": 1000, "height": 500})
    page.fill("#prompt", "a long story")
    page.click("#send")
    box = "document.getElementById('messages')"
    page.wait_for_function(f"() => {box}.scrollHeight > {box}.clientHeight + 300")
    # Scrolled up to read: the answer grows below, the view stays. Back at the end, it follows again.
    page.evaluate(f"{box}.scrollTop = 0")
    height = page.evaluate(f"{box}.scrollHeight")
    page.wait_for_function(f"() => {box}.scrollHeight > {height} + 100")
    assert page.evaluate(f"{box}.scrollTop") == 0
    page.evaluate(f"{box}.scrollTop = {box}.scrollHeight")
    height = page.evaluate(f"{box}.scrollHeight")
    page.wait_for_function(f"() => {box}.scrollHeight > {height} + 100")
    assert page.evaluate(f"{box}.scrollHeight - {box}.scrollTop - {box}.clientHeight") < 40
    # The answer's last drawing (Stop here) leaves the view where it was, too.
    page.evaluate(f"{box}.scrollTop = 0")
    page.click("#stop")
    page.wait_for_selector(".msg.assistant .stats:has-text('stopped')")
    assert page.evaluate(f"{box}.scrollTop") == 0
    context.close()


# An answer that streams 30 words, a word every 20 ms, then ends: "<the question> -> w1 ... w30" (the
# question: the last message sent), so two tabs answering at once stream at the same time.
NAMED_ANSWER = """
(() => {
  const realFetch = window.fetch;
  window.fetch = (url, options) => {
    if (!String(url).endsWith("chat/completions")) return realFetch(url, options);
    const messages = JSON.parse(options.body).messages;
    const words = [messages[messages.length - 1].content + " ->"];
    for (let i = 1; i <= 30; i++) words.push(" w" + i);
    const encoder = new TextEncoder();
    const event = (delta, finish_reason) =>
      "data: " + JSON.stringify({ choices: [{ index: 0, delta, finish_reason }] }) + "\\n\\n";
    const body = new ReadableStream({
      start(controller) {
        let i = 0;
        const timer = setInterval(() => {
          if (i < words.length) {
            controller.enqueue(encoder.encode(event({ content: words[i++] }, null)));
            return;
          }
          clearInterval(timer);
          controller.enqueue(encoder.encode(event({}, "stop") + "data: [DONE]\\n\\n"));
          controller.close();
        }, 20);
        options.signal.addEventListener("abort", () => {
          clearInterval(timer);
          controller.error(new DOMException("aborted", "AbortError"));
        });
      },
    });
    return Promise.resolve(new Response(body, { headers: { "Content-Type": "text/event-stream" } }));
  };
})();
"""


def test_two_tabs_answering_in_one_conversation_keep_both_answers(browser, keyed_server: LiveServer):
    context, _ = _routed_context(browser, keyed_server)
    context.unroute("**/v1/chat/completions")
    context.add_init_script(NAMED_ANSWER)
    a = _open(context, keyed_server)
    b = _open(context, keyed_server)  # shares a's storage, as a second tab does
    stored = (
        "() => JSON.parse(localStorage.getItem('mlx-infer.chat.v1')).conversations"
        ".map(c => c.messages.map(m => [m.role, m.content]))"
    )
    shown = "() => [...document.querySelectorAll('#messages .msg .content')].map(e => e.textContent.trim())"
    answer = " ->" + "".join(f" w{i}" for i in range(1, 31))

    a.fill("#prompt", "first")
    a.press("#prompt", "Enter")
    a.wait_for_selector(".msg.assistant .stats:has-text('stop')")
    b.wait_for_selector("#conversations .open:has-text('first')")
    b.click("#conversations .open:has-text('first')")
    b.wait_for_selector(".msg.assistant .stats:has-text('stop')")

    # Both tabs ask at once in the same conversation: both questions and both whole answers stay.
    a.fill("#prompt", "A: same conv")
    b.fill("#prompt", "B: same conv")
    a.press("#prompt", "Enter")
    b.press("#prompt", "Enter")
    for page in (a, b):
        page.wait_for_selector("#send:not([hidden])")
    expected = ["first", "first" + answer, "A: same conv", "A: same conv" + answer, "B: same conv"]
    (messages,) = a.evaluate(stored)
    assert [content for _, content in messages[:5]] == expected, messages
    assert messages[5][1].startswith("B: same conv ->") and len(messages) == 6, messages  # (sent with A's)
    for page in (a, b):
        page.wait_for_function(f"() => ({shown})().length === 6")
        assert page.evaluate(shown)[:5] == expected
    c = _open(context, keyed_server)
    c.click("#conversations .open:has-text('first')")
    assert c.evaluate(shown) == [content for _, content in messages]
    c.close()

    # Edit in one tab cuts the conversation there in both; a deleted conversation goes from both.
    b.click(".msg.user >> nth=1 >> .edit")
    b.fill(".msg.user .edit-box", "edited")
    b.click(".msg.user .resend")
    b.wait_for_selector("#send:not([hidden])")
    cut = ["first", "first" + answer, "edited", "edited" + answer]
    for page in (a, b):
        page.wait_for_function(f"(cut) => JSON.stringify(({shown})()) === JSON.stringify(cut)", arg=cut)
    assert [content for _, content in a.evaluate(stored)[0]] == cut
    a.click("#conversations li:has-text('first') .delete")
    b.wait_for_function("() => document.querySelectorAll('#conversations li').length === 0")
    assert b.evaluate(shown) == [] and a.evaluate(stored) == []
    context.close()
