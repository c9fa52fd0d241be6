"""The chat web page in Debian's Chromium, driven by Playwright, against a real `novainfer serve`.

One server (a tiny random model, an API key) and one browser serve the whole module; each test gets a fresh
browser context, so its localStorage starts empty. Where a test needs an exact reply (HTML in the model's
output, errors the tiny model cannot produce) it answers the page's request itself with `page.route`;
everything else goes to the server. `ignore_eos` is added to the page's requests (with `route.continue_`) where
a test needs an answer of a known length.
"""

import json
import os
import re
import uuid

import httpx
import pytest

sync_api = pytest.importorskip("playwright.sync_api")
from playwright.sync_api import expect, sync_playwright  # noqa: E402

from tests.server_utils import FLOAT32, ROOT, RemoteServer  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not os.path.exists(CHROMIUM), reason="needs Debian's chromium (make browser)"),
]

MODEL = "tiny"
API_KEY = "webui-test-key"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
SCREENSHOTS = os.path.join(ROOT, "docs", "screenshots")
STORE_KEY = "novainfer.webui.chats"
CHAT = "**/v1/chat/completions"


@pytest.fixture(scope="module")
def server(tiny_qwen2, tmp_path_factory):
    srv = RemoteServer(
        [tiny_qwen2, "--served-model-name", MODEL, *FLOAT32, "--max-model-len", "512", "--api-key", API_KEY],
        str(tmp_path_factory.mktemp("webui") / "server.log"),
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],
        )
        yield chromium
        chromium.close()


def open_page(browser, server, viewport=DESKTOP, **context_args):
    context = browser.new_context(viewport=viewport, **context_args)
    page = context.new_page()
    page.set_default_timeout(20_000)
    page.js_errors = []
    page.on("pageerror", lambda error: page.js_errors.append(error))
    page.goto(server.url)
    expect(page.locator("#prompt")).to_be_focused()
    return page


@pytest.fixture
def page(browser, server):
    """A desktop page with the API key set, greedy decoding and short answers."""
    page = open_page(browser, server)
    configure(page, api_key=API_KEY, temperature="0", max_tokens="8")
    expect(page.locator("#model-select option")).to_have_text([MODEL])
    yield page
    errors = page.js_errors
    page.context.close()
    server.wait_idle(timeout=30)
    assert not errors, errors


# ---- helpers ------------------------------------------------------------------------------------------------
def configure(
    page, *, api_key=None, system=None, temperature=None, top_p=None, max_tokens=None, stream=None, theme=None
):
    """Fill the settings dialog as a user would."""
    page.get_by_role("button", name="Settings").click()
    dialog = page.locator("#settings-dialog")
    expect(dialog).to_be_visible()
    for label, value in (
        ("API key", api_key),
        ("System prompt", system),
        ("Temperature", temperature),
        ("Top p", top_p),
        ("Max tokens", max_tokens),
    ):
        if value is not None:
            dialog.get_by_label(label, exact=True).fill(value)
    if stream is not None:
        dialog.get_by_label("Stream the answer token by token").set_checked(stream)
    if theme is not None:
        dialog.get_by_label("Theme").select_option(theme)
    dialog.get_by_role("button", name="Done").click()
    expect(dialog).to_be_hidden()


def send(page, text):
    page.locator("#prompt").fill(text)
    page.locator("#prompt").press("Enter")


def wait_idle_page(page):
    """The answer finished: the send button is back and nothing is marked as streaming."""
    expect(page.get_by_role("button", name="Stop generating")).to_be_hidden()
    expect(page.get_by_role("button", name="Send message")).to_be_visible()
    expect(page.locator('#thread article[data-status="streaming"]')).to_have_count(0)


def answers(page):
    return page.locator("#thread article.assistant")


def user_texts(page):
    return page.locator("#thread article.user .bubble").all_text_contents()


def stored_sessions(page):
    return json.loads(page.evaluate(f"localStorage.getItem('{STORE_KEY}')"))["sessions"]


def active_messages(page):
    store = json.loads(page.evaluate(f"localStorage.getItem('{STORE_KEY}')"))
    session = next(s for s in store["sessions"] if s["id"] == store["activeSessionId"])
    return session["messages"]


def force_ignore_eos(page):
    """The page's chat requests go to the server with ignore_eos, so answers run to max_tokens."""

    def add_ignore_eos(route):
        route.continue_(post_data=json.dumps({**route.request.post_data_json, "ignore_eos": True}))

    page.route(CHAT, add_ignore_eos)


def sse_body(*pieces, usage=None, error=None, reasoning=()):
    """An OpenAI-style SSE stream carrying the given text pieces (after reasoning pieces, as a thinking model's)."""
    chunks = [
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ]
    chunks += [
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"reasoning_content": r, "reasoning": r}, "finish_reason": None}],
        }
        for r in reasoning
    ]
    chunks += [
        {
            "id": "chatcmpl-fake",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}],
        }
        for p in pieces
    ]
    if error is not None:
        chunks.append({"error": error})
    else:
        chunks.append(
            {
                "id": "chatcmpl-fake",
                "object": "chat.completion.chunk",
                "model": MODEL,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            }
        )
        if usage is not None:
            chunks.append(
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion.chunk",
                    "model": MODEL,
                    "choices": [],
                    "usage": usage,
                }
            )
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"


def fulfil_sse(body, request_id="fake-request"):
    def handler(route):
        route.fulfill(status=200, body=body, headers={"Content-Type": "text/event-stream", "X-Request-Id": request_id})

    return handler


def sse_deltas(text):
    """The concatenated delta contents and the usage of an SSE response body."""
    content, usage = "", None
    for line in text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                content += choice.get("delta", {}).get("content") or ""
            usage = chunk.get("usage") or usage
    return content, usage


RECORD_ANSWER_LENGTHS = """() => {
  window.answerLengths = [];
  new MutationObserver(() => {
    const all = document.querySelectorAll('#thread article.assistant .content');
    if (all.length) window.answerLengths.push(all[all.length - 1].textContent.length);
  }).observe(document.getElementById('thread'), {childList: true, subtree: true, characterData: true});
}"""


# ---- streaming, stats, stop ---------------------------------------------------------------------------------
def test_answer_streams_token_by_token_with_stats(page, server):
    force_ignore_eos(page)
    configure(page, max_tokens="400")  # long enough (~1 s here) to arrive over many frames even on a busy machine
    page.evaluate(RECORD_ANSWER_LENGTHS)
    with page.expect_response(CHAT) as response_info:
        send(page, "Tell me a long story")
    wait_idle_page(page)
    response = response_info.value
    body = response.request.post_data_json
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["model"] == MODEL and body["temperature"] == 0 and body["max_tokens"] == 400
    assert body["messages"] == [{"role": "user", "content": "Tell me a long story"}]
    assert response.request.headers["authorization"] == f"Bearer {API_KEY}"

    # the answer grew in many steps while it streamed, never shrinking
    lengths = [n for n in page.evaluate("window.answerLengths") if n > 0]
    assert len(set(lengths)) >= 3, lengths
    assert lengths == sorted(lengths)
    # what the page kept is exactly the concatenation of the server's deltas, in order
    streamed, usage = sse_deltas(response.text())
    assert usage["completion_tokens"] == 400
    answer = active_messages(page)[-1]
    assert answer["role"] == "assistant" and answer["content"] == streamed and answer["status"] == "done"

    stats = answers(page).last.locator(".stats")
    expect(stats).to_have_attribute("data-tokens", "400")
    expect(stats.locator(".stat-tokens")).to_have_text("400 tokens")
    expect(stats.locator(".stat-speed")).to_have_text(re.compile(r"^\d+\.\d tok/s$"))
    expect(stats.locator(".stat-ttft")).to_have_text(re.compile(r"^TTFT \d+(\.\d+)? m?s$"))
    expect(stats.locator(".stat-cached")).to_have_text(
        f"prefix cache {usage['prompt_tokens_details']['cached_tokens']}/{usage['prompt_tokens']}"
    )
    expect(stats.locator(".stat-request")).to_have_attribute("title", f"request id {response.headers['x-request-id']}")


def test_stop_cancels_on_the_server(page, server):
    force_ignore_eos(page)
    configure(page, max_tokens="470", temperature="0.8")
    generated = server.metric("novainfer:generation_tokens_total", model_name=MODEL)
    aborted = server.metric("novainfer:request_success_total", model_name=MODEL, finished_reason="abort")
    send(page, "Count to a thousand")
    content = answers(page).last.locator(".content")
    expect(content).to_have_text(re.compile(r"\S{3}"))  # a few tokens arrived
    assert server.metric("novainfer:num_requests_running", model_name=MODEL) == 1
    page.get_by_role("button", name="Stop generating").click()

    wait_idle_page(page)
    server.wait_idle()
    assert server.metric("novainfer:num_requests_running", model_name=MODEL) == 0
    assert server.metric("novainfer:request_success_total", model_name=MODEL, finished_reason="abort") == aborted + 1
    assert server.metric("novainfer:generation_tokens_total", model_name=MODEL) - generated < 470
    expect(answers(page).last.locator(".badge-stopped")).to_have_text("stopped")
    kept = content.text_content()
    assert kept
    page.wait_for_timeout(700)  # watching for text arriving after the stop: a wait is the point here
    assert content.text_content() == kept
    assert active_messages(page)[-1]["status"] == "stopped"
    # the page is usable again: a short answer replaces the stopped one (a next turn could overflow the
    # 512-token context, depending on how much of the stopped answer arrived)
    configure(page, max_tokens="8")
    page.get_by_role("button", name="Regenerate answer").click()
    wait_idle_page(page)
    errors = page.locator("#thread article.error").all_text_contents()
    assert not errors, f"the regenerated answer failed: {errors} (server log: {server.log_path})"
    expect(answers(page)).to_have_count(1)
    expect(answers(page).last).to_have_attribute("data-status", "done")
    expect(answers(page).last.locator(".stats")).to_have_attribute("data-tokens", "8")


# ---- conversations: history, switching, edit and regenerate --------------------------------------------------
def test_conversations_survive_reload_switch_rename_delete(page, server):
    send(page, "alpha question")
    wait_idle_page(page)
    alpha_answer = answers(page).last.locator(".content").text_content()
    # a second conversation, started while the first one's next answer is still streaming
    force_ignore_eos(page)
    configure(page, max_tokens="300")
    send(page, "alpha follow-up")
    expect(answers(page).last.locator(".content")).to_have_text(re.compile(r"\S"))
    page.get_by_role("button", name="New chat").click()
    expect(page.locator("#thread .empty-state")).to_be_visible()
    expect(page.get_by_role("button", name="Send message")).to_be_visible()  # this conversation is idle
    server.wait_idle(timeout=60)  # the first conversation's answer finishes in the background
    expect(page.locator("#thread article")).to_have_count(0)  # ... and never shows up here
    page.unroute(CHAT)
    configure(page, max_tokens="8")
    send(page, "bravo question")
    wait_idle_page(page)

    items = page.locator("#conversation-list .conversation-open")
    expect(items).to_have_text(["bravo question", "alpha question"])  # most recent first
    items.filter(has_text="alpha question").click()
    assert user_texts(page) == ["alpha question", "alpha follow-up"]
    expect(answers(page)).to_have_count(2)
    expect(answers(page).first.locator(".content")).to_have_text(alpha_answer)
    expect(answers(page).last.locator(".stats")).to_have_attribute("data-tokens", "300")
    items.filter(has_text="bravo question").click()
    assert user_texts(page) == ["bravo question"]
    expect(answers(page)).to_have_count(1)

    page.reload()
    expect(page.locator("#conversation-list .conversation-open")).to_have_text(["bravo question", "alpha question"])
    expect(page.locator("#chat-title")).to_have_text("bravo question")
    assert user_texts(page) == ["bravo question"]
    expect(answers(page)).to_have_count(1)
    items.filter(has_text="alpha question").click()
    assert user_texts(page) == ["alpha question", "alpha follow-up"]
    expect(answers(page).first.locator(".content")).to_have_text(alpha_answer)

    # rename (kept over a reload), then delete
    page.get_by_role("button", name="Rename conversation: alpha question").click()
    rename = page.get_by_label("Conversation name")
    rename.fill("Renamed alpha")
    rename.press("Enter")
    expect(items).to_have_text(["bravo question", "Renamed alpha"])
    page.reload()
    expect(items).to_have_text(["bravo question", "Renamed alpha"])
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Delete conversation: Renamed alpha").click()
    expect(items).to_have_text(["bravo question"])
    assert user_texts(page) == ["bravo question"]
    assert [s["messages"][0]["content"] for s in stored_sessions(page)] == ["bravo question"]


def test_edit_earlier_message_and_regenerate(page, server):
    bodies = []
    page.on("request", lambda r: bodies.append(r.post_data_json) if r.url.endswith("/v1/chat/completions") else None)
    send(page, "first question")
    wait_idle_page(page)
    send(page, "second question")
    wait_idle_page(page)
    expect(page.locator("#thread article")).to_have_count(4)
    assert bodies[1]["session_id"] == bodies[0]["session_id"]  # the same conversation on the server
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]

    page.locator("#thread article.user").first.hover()
    page.get_by_role("button", name="Edit message and regenerate").first.click()
    editor = page.get_by_role("textbox", name="Edit message")
    expect(editor).to_have_value("first question")
    editor.fill("first question, edited")
    editor.press("Enter")
    wait_idle_page(page)
    assert user_texts(page) == ["first question, edited"]
    expect(answers(page)).to_have_count(1)
    assert bodies[2]["messages"] == [{"role": "user", "content": "first question, edited"}]
    assert bodies[2]["session_id"] != bodies[0]["session_id"]  # a new branch: the server's history is not reused
    first_id = answers(page).last.locator(".stat-request").get_attribute("title")

    page.get_by_role("button", name="Regenerate answer").click()
    wait_idle_page(page)
    assert bodies[3]["messages"] == [{"role": "user", "content": "first question, edited"}]
    expect(page.locator("#thread article")).to_have_count(2)
    expect(answers(page).last.locator(".stat-request")).not_to_have_attribute("title", first_id)
    # editing can be cancelled with Escape, leaving the conversation as it was
    page.get_by_role("button", name="Edit message and regenerate").click()
    page.get_by_role("textbox", name="Edit message").press("Escape")
    assert user_texts(page) == ["first question, edited"]
    assert len(bodies) == 4


# ---- safety and markdown -----------------------------------------------------------------------------------
def test_model_output_is_shown_as_text_and_markdown_renders_safely(page):
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    payload = "<img src=x onerror=alert(1)>"
    page.route(
        CHAT,
        fulfil_sse(
            sse_body(
                f"Look: {payload} and <script>alert(2)</script>\n\n",
                "```html\n<b>not bold</b>\n```\n\n",
                "**real bold**, `inline <i>code</i>`, [bad](javascript:alert(3)) and [good](https://example.com/docs)\n\n",
                "- one\n- two\n\n| a | b |\n|---|---|\n| <u>1</u> | 2 |\n",
                usage={
                    "prompt_tokens": 10,
                    "completion_tokens": 40,
                    "total_tokens": 50,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
            )
        ),
    )
    send(page, payload)  # the user's own text is not HTML either

    def check():
        wait_idle_page(page)
        thread = page.locator("#thread")
        expect(page.locator("#thread article.user .bubble")).to_have_text(payload)
        content = answers(page).last.locator(".content")
        expect(content.locator("p").first).to_have_text(f"Look: {payload} and <script>alert(2)</script>")
        for tag in ("img", "script", "b", "i", "u", "iframe"):
            expect(thread.locator(tag)).to_have_count(0)
        code = content.locator("pre > code")
        expect(code).to_have_text("<b>not bold</b>")
        expect(code).to_have_class("language-html")
        expect(content.locator("strong")).to_have_text("real bold")
        expect(content.locator(":not(pre) > code")).to_have_text("inline <i>code</i>")
        expect(content.locator("a")).to_have_count(1)
        expect(content.locator("a")).to_have_attribute("href", "https://example.com/docs")
        expect(content.locator("a")).to_have_attribute("rel", re.compile("noopener"))
        expect(content).to_contain_text("[bad](javascript:alert(3))")
        expect(content.locator("ul > li")).to_have_text(["one", "two"])
        expect(content.locator("table td")).to_have_text(["<u>1</u>", "2"])

    check()
    page.reload()  # rendered again from localStorage
    check()
    assert dialogs == []


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_reasoning_is_shown_collapsed_above_the_answer(page, stream):
    """Streamed: the reasoning arrives in deltas before the answer's; whole: in message.reasoning_content."""
    if stream:
        page.route(CHAT, fulfil_sse(sse_body("The answer is **4**.", reasoning=("Two plus two ", "<b>is</b> four."))))
    else:
        configure(page, stream=False)
        message = {
            "role": "assistant",
            "content": "The answer is **4**.",
            "reasoning_content": "Two plus two <b>is</b> four.",
            "reasoning": "Two plus two <b>is</b> four.",
        }
        body = {
            "id": "chatcmpl-fake",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12},
        }
        page.route(
            CHAT,
            lambda route: route.fulfill(
                status=200, body=json.dumps(body), headers={"Content-Type": "application/json"}
            ),
        )
    send(page, "2+2?")

    def check():
        wait_idle_page(page)
        content = answers(page).last.locator(".content")
        details = content.locator("details.reasoning")
        expect(details).to_have_count(1)
        expect(details).not_to_have_attribute("open", "")
        expect(details.locator(".reasoning-text")).to_be_hidden()
        expect(content.locator("p")).to_have_text("The answer is 4.")  # the answer itself, not the reasoning
        assert content.evaluate("c => c.firstElementChild.tagName") == "DETAILS"  # above the answer
        details.locator("summary").click()
        expect(details.locator(".reasoning-text")).to_have_text("Two plus two <b>is</b> four.")
        expect(content.locator("details b")).to_have_count(0)

    check()
    assert stored_sessions(page)[0]["messages"][1]["reasoning"] == "Two plus two <b>is</b> four."
    page.reload()  # rendered again from localStorage
    check()


# ---- errors -----------------------------------------------------------------------------------------------
def test_errors_show_request_id_and_the_page_recovers(page, server):
    def last_error():
        return page.locator("#thread article.error").last

    # a real 400 from the server: max_tokens beyond the 512-token context
    configure(page, max_tokens="100000")
    with page.expect_response(CHAT) as info:
        send(page, "too long please")
    assert info.value.status == 400
    wait_idle_page(page)
    expect(last_error()).to_contain_text("maximum context length")
    expect(last_error().locator(".request-id")).to_have_text(info.value.headers["x-request-id"])
    expect(last_error()).to_contain_text("400")
    expect(answers(page)).to_have_count(0)

    # 429 with Retry-After
    page.route(
        CHAT,
        lambda route: route.fulfill(
            status=429,
            headers={"X-Request-Id": "rid-429", "Retry-After": "3"},
            content_type="application/json",
            body=json.dumps(
                {
                    "error": {
                        "message": "Server busy: 512 requests queued",
                        "type": "rate_limit_error",
                        "param": None,
                        "code": "rate_limit_exceeded",
                        "request_id": "rid-429",
                    }
                }
            ),
        ),
    )
    send(page, "busy?")
    wait_idle_page(page)
    expect(last_error()).to_contain_text("Server busy: 512 requests queued")
    expect(last_error()).to_contain_text("429")
    expect(last_error()).to_contain_text("retry after 3 s")
    expect(last_error().locator(".request-id")).to_have_text("rid-429")
    page.unroute(CHAT)

    # a 502 from a proxy, not JSON: the status text and the header's id
    page.route(
        CHAT,
        lambda route: route.fulfill(
            status=502,
            body="<html>Bad gateway</html>",
            headers={"X-Request-Id": "rid-502", "Content-Type": "text/html"},
        ),
    )
    send(page, "proxy?")
    wait_idle_page(page)
    expect(last_error()).to_contain_text("502")
    expect(last_error().locator(".request-id")).to_have_text("rid-502")
    expect(page.locator("#thread b")).to_have_count(0)
    page.unroute(CHAT)

    # the server is down: the page names the request id it sent
    page.route(CHAT, lambda route: route.abort("connectionrefused"))
    with page.expect_request(CHAT) as sent:
        send(page, "anyone there?")
    wait_idle_page(page)
    expect(last_error()).to_contain_text("Could not reach the server")
    expect(last_error().locator(".request-id")).to_have_text(sent.value.headers["x-request-id"])
    page.unroute(CHAT)

    # an error in the middle of a stream: the partial answer stays, marked incomplete
    page.route(
        CHAT,
        fulfil_sse(
            sse_body(
                "partial answer ",
                error={
                    "message": "the engine died",
                    "type": "service_unavailable",
                    "param": None,
                    "code": 503,
                    "request_id": "rid-stream",
                },
            ),
            request_id="rid-stream",
        ),
    )
    send(page, "stream then fail")
    wait_idle_page(page)
    expect(answers(page).last.locator(".content")).to_have_text("partial answer")
    expect(answers(page).last.locator(".badge-error")).to_have_text("incomplete")
    expect(last_error()).to_contain_text("the engine died")
    expect(last_error().locator(".request-id")).to_have_text("rid-stream")
    page.unroute(CHAT)

    # every error was kept in order, none was sent to the model; Retry works against the real server again
    expect(page.locator("#thread article.error")).to_have_count(5)
    configure(page, max_tokens="8")
    with page.expect_request(CHAT) as retried:
        last_error().get_by_role("button", name="Retry").click()
    wait_idle_page(page)
    # the retry replaces the incomplete answer and its error; the earlier failed turns were never answered
    roles = [m["role"] for m in retried.value.post_data_json["messages"]]
    assert roles == ["user"] * 5
    expect(answers(page)).to_have_count(1)
    expect(answers(page).last).to_have_attribute("data-status", "done")
    expect(page.locator("#thread article.error")).to_have_count(4)
    send(page, "and once more")
    wait_idle_page(page)
    expect(answers(page).last).to_have_attribute("data-status", "done")


# ---- settings, API key, non-streaming, prefix cache ---------------------------------------------------------
def test_settings_persist_and_api_key_is_sent(browser, server):
    page = open_page(browser, server)
    try:
        # no key yet: the model list and a chat request fail with 401, shown with the request id
        expect(page.locator("#notice")).to_contain_text("Set the API key in Settings")
        with page.expect_response(CHAT) as info:
            send(page, "hello without a key")
        assert info.value.status == 401
        expect(page.locator("#thread article.error .request-id")).to_have_text(info.value.headers["x-request-id"])

        system = "You are a terse assistant."
        configure(page, api_key=API_KEY, system=system, temperature="0.3", top_p="0.9", max_tokens="12", stream=False)
        expect(page.locator("#model-select option")).to_have_text([MODEL])
        expect(page.locator("#model-select")).to_have_value(MODEL)
        page.reload()
        page.get_by_role("button", name="Settings").click()
        dialog = page.locator("#settings-dialog")
        expect(dialog.get_by_label("API key")).to_have_value(API_KEY)
        expect(dialog.get_by_label("System prompt")).to_have_value(system)
        expect(dialog.get_by_label("Temperature")).to_have_value("0.3")
        expect(dialog.get_by_label("Top p")).to_have_value("0.9")
        expect(dialog.get_by_label("Max tokens")).to_have_value("12")
        expect(dialog.get_by_label("Stream the answer token by token")).not_to_be_checked()
        dialog.press("Escape")
        expect(dialog).to_be_hidden()
        expect(page.locator("#model-select")).to_have_value(MODEL)

        # non-streaming: one JSON answer, rendered whole
        force_ignore_eos(page)
        with page.expect_response(CHAT) as info:
            send(page, "hello with a key")
        wait_idle_page(page)
        response = info.value
        request = response.request
        assert response.status == 200
        assert request.headers["authorization"] == f"Bearer {API_KEY}"
        body = request.post_data_json
        assert body["model"] == MODEL and body["stream"] is False and "stream_options" not in body
        assert body["temperature"] == 0.3 and body["top_p"] == 0.9 and body["max_tokens"] == 12
        assert body["messages"][0] == {"role": "system", "content": system}
        assert body["messages"][-1] == {"role": "user", "content": "hello with a key"}
        assert body["session_id"]
        reply = response.json()
        assert active_messages(page)[-1]["content"] == reply["choices"][0]["message"]["content"]
        stats = answers(page).last.locator(".stats")
        expect(stats).to_have_attribute("data-tokens", "12")
        expect(stats.locator(".stat-total")).to_be_visible()  # no time to first token without streaming
        expect(stats.locator(".stat-ttft")).to_have_count(0)
        assert not page.js_errors
    finally:
        page.context.close()


def test_cached_prompt_tokens_shown_on_second_turn(page, server):
    # a unique system prompt long enough to fill several 16-token KV blocks
    system = f"{uuid.uuid4().hex} You are NovaInfer, a helpful assistant. " + " ".join(
        ["The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks."] * 4
    )
    configure(page, system=system)
    with page.expect_response(CHAT) as first:
        send(page, "first turn")
    wait_idle_page(page)
    _, usage = sse_deltas(first.value.text())
    expect(answers(page).last.locator(".stats")).to_have_attribute("data-cached", "0")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 and usage["prompt_tokens"] > 100

    with page.expect_response(CHAT) as second:
        send(page, "second turn")
    wait_idle_page(page)
    _, usage = sse_deltas(second.value.text())
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 96  # the system prompt's full blocks at least
    stats = answers(page).last.locator(".stats")
    expect(stats).to_have_attribute("data-cached", str(cached))
    expect(stats.locator(".stat-cached")).to_have_text(f"prefix cache {cached}/{usage['prompt_tokens']}")
    first_body, second_body = first.value.request.post_data_json, second.value.request.post_data_json
    assert second_body["session_id"] == first_body["session_id"]
    assert second_body["messages"][:2] == first_body["messages"]


# ---- layout, themes, keyboard -----------------------------------------------------------------------------
DEMO_ANSWER = [
    "Stream the answer with `stream: true` and read the server-sent events as they arrive:\n\n",
    '```python\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-")\n',
    'stream = client.chat.completions.create(\n    model="tiny", stream=True,\n',
    '    messages=[{"role": "user", "content": "Hello!"}])\nfor chunk in stream:\n',
    '    print(chunk.choices[0].delta.content or "", end="")\n```\n\n',
    "- **session_id** keeps the conversation on the server\n- the usage chunk reports `cached_tokens`\n",
]
DEMO_USAGE = {
    "prompt_tokens": 231,
    "completion_tokens": 96,
    "total_tokens": 327,
    "prompt_tokens_details": {"cached_tokens": 208},
}


def no_horizontal_overflow(page):
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def background_luminance(page, selector="body"):
    rgb = page.eval_on_selector(selector, "e => getComputedStyle(e).backgroundColor")
    r, g, b = (int(x) for x in re.findall(r"\d+", rgb)[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_desktop_and_phone_layouts_light_and_dark(browser, server):
    """Also saves the README's screenshots. The replies are canned (the test model's output is random bytes)."""
    os.makedirs(SCREENSHOTS, exist_ok=True)
    page = open_page(browser, server, color_scheme="light")
    try:
        configure(page, api_key=API_KEY)
        page.route(
            CHAT,
            fulfil_sse(
                sse_body(
                    "Sure: what would you like to know?",
                    usage={
                        "prompt_tokens": 14,
                        "completion_tokens": 9,
                        "total_tokens": 23,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                )
            ),
        )
        send(page, "Hi! Can you help me with the NovaInfer API?")
        wait_idle_page(page)
        page.get_by_role("button", name="New chat").click()
        page.unroute(CHAT)
        page.route(CHAT, fulfil_sse(sse_body(*DEMO_ANSWER, usage=DEMO_USAGE)))
        send(page, "How do I stream a chat answer from NovaInfer in Python?")
        wait_idle_page(page)
        expect(page.locator("#sidebar")).to_be_in_viewport()
        expect(page.get_by_role("button", name="Show conversations")).to_be_hidden()
        assert no_horizontal_overflow(page)
        assert background_luminance(page) > 0.9
        page.mouse.move(0, 0)
        page.screenshot(path=os.path.join(SCREENSHOTS, "webui-desktop.png"))

        # the toggle switches to dark, and the choice is kept
        page.get_by_role("button", name="Switch to dark theme").click()
        expect(page.locator("html")).to_have_attribute("data-theme", "dark")
        assert background_luminance(page) < 0.2
        page.reload()
        expect(page.get_by_role("button", name="Switch to light theme")).to_be_visible()
        assert background_luminance(page) < 0.2
        page.get_by_role("button", name="Switch to light theme").click()
        assert background_luminance(page) > 0.9
        storage = page.context.storage_state()
    finally:
        page.context.close()

    # the system's dark preference is followed when no theme was chosen
    page = open_page(browser, server, color_scheme="dark", storage_state=storage)
    try:
        assert background_luminance(page) > 0.9  # the light theme chosen above
        configure(page, theme="system")
        expect(page.locator("#thread article.assistant")).to_have_count(1)
        assert background_luminance(page) < 0.2
        assert background_luminance(page, ".composer-box") < 0.3
        page.mouse.move(0, 0)
        page.screenshot(path=os.path.join(SCREENSHOTS, "webui-desktop-dark.png"))
    finally:
        page.context.close()

    # phone: the conversation list is a drawer, nothing overflows sideways, the input stays on screen
    page = open_page(
        browser, server, viewport=PHONE, storage_state=storage, is_mobile=True, has_touch=True, device_scale_factor=2
    )
    try:
        expect(page.locator("#thread article.assistant")).to_have_count(1)
        expect(page.locator("#sidebar")).not_to_be_in_viewport()
        expect(page.locator("#prompt")).to_be_in_viewport()
        expect(page.get_by_role("button", name="Send message")).to_be_in_viewport()
        assert no_horizontal_overflow(page)
        page.screenshot(path=os.path.join(SCREENSHOTS, "webui-phone.png"))
        toggle = page.get_by_role("button", name="Show conversations")
        toggle.click()
        expect(page.locator("#sidebar")).to_be_in_viewport(ratio=0.9)
        expect(toggle).to_have_attribute("aria-expanded", "true")
        page.keyboard.press("Escape")
        expect(page.locator("#sidebar")).not_to_be_in_viewport()
        toggle.click()
        page.locator("#conversation-list .conversation-open").filter(has_text="Hi! Can you help").click()
        expect(page.locator("#sidebar")).not_to_be_in_viewport()
        expect(page.locator("#thread article.user .bubble")).to_have_text(
            ["Hi! Can you help me with the NovaInfer API?"]
        )
        assert no_horizontal_overflow(page)
    finally:
        page.context.close()


def test_keyboard_and_accessible_names(page):
    requests = []
    page.on("request", lambda r: requests.append(r) if r.url.endswith("/v1/chat/completions") else None)
    prompt = page.locator("#prompt")
    prompt.press_sequentially("line one")
    prompt.press("Shift+Enter")
    prompt.press_sequentially("line two")
    expect(prompt).to_have_value("line one\nline two")
    assert requests == []
    # Tab reaches the send button, which shows a focus ring
    prompt.press("Tab")
    send_button = page.get_by_role("button", name="Send message")
    expect(send_button).to_be_focused()
    outline = send_button.evaluate("b => [getComputedStyle(b).outlineStyle, getComputedStyle(b).outlineWidth]")
    assert outline[0] != "none" and outline[1] != "0px", outline
    prompt.focus()
    prompt.press("Enter")
    wait_idle_page(page)
    expect(page.locator("#thread article.user .bubble")).to_have_text("line one\nline two")
    assert len(requests) == 1
    expect(prompt).to_have_value("")
    expect(prompt).to_be_focused()

    # every button and form control has an accessible name
    unnamed = page.evaluate("""() => [...document.querySelectorAll('button, select, textarea, input')]
        .filter(e => e.offsetParent !== null || e.closest('dialog'))
        .filter(e => !(e.getAttribute('aria-label') || e.labels?.length || e.textContent.trim()))
        .map(e => e.outerHTML.slice(0, 80))""")
    assert unnamed == []
    # the settings dialog opens from the keyboard and Escape closes it, focus back in the input
    page.get_by_role("button", name="Settings").focus()
    page.keyboard.press("Enter")
    expect(page.locator("#settings-dialog")).to_be_visible()
    page.keyboard.press("Escape")
    expect(page.locator("#settings-dialog")).to_be_hidden()
    expect(prompt).to_be_focused()


def test_page_and_assets_load_without_the_api_key(server):
    for path, kind in (("/", "text/html"), ("/webui/app.js", "javascript"), ("/webui/styles.css", "text/css")):
        resp = httpx.get(server.url + path, timeout=10)
        assert resp.status_code == 200 and kind in resp.headers["content-type"], path
    page = httpx.get(server.url + "/", timeout=10).text
    assert 'src="webui/app.js"' in page and 'href="webui/styles.css"' in page
    for path in ("/webui/%2e%2e/server/api_server.py", "/webui/..%2f..%2fconfig.py", "/webui/nope.js"):
        resp = httpx.get(server.url + path, timeout=10)
        assert resp.status_code == 404 and resp.json()["error"]["request_id"], path
    assert httpx.get(server.url + "/v1/models", timeout=10).status_code == 401  # the API itself still needs it
