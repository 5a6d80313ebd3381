"""The built-in page as a voice agent's client, in a real headless Chromium, against `duplexd serve` with an STT main
model, `--tts demo-tts` and `--llm demo` (a real llama.cpp server with SmolLM2-135M).

The fake microphone says one espeak-ng sentence (after 2.5 s of quiet, so the session is open when it comes, then
30 s of quiet before the file loops), which the STT (`test_asr_e2e.words_model`, its text head leaning to words)
hears as the user's turn. The page is told by its address to force its tool (`?tool_choice=required`), so the turn
gets a `set_volume` call whatever the tiny LLM would choose; the page answers it (the volume moves), asks for a
reply, and the reply comes and plays: over the WebSocket and over a WebRTC call (the page's agent code reads
either). The demo STT also hears words in the silence, turns of their own: the page turns barge-in off
(`?interrupt=0`) so they do not cut the reply. What the 135M model guarantees is asserted, not what it chooses: a
reply is a line with text, in letters or not (after those junk turns it has answered "# # #").
Screenshots are copied to out/ (git-ignored).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from duplexd.clients.audio import write_wav

from .browser import CHROMIUM, launch_args
from .live_server import running_server
from .speech import compose, speak
from .system_tools import needs
from .test_asr_e2e import words_model

sync_api = pytest.importorskip("playwright.sync_api")
pytestmark = needs("chromium", "espeak-ng")
OUT = Path(__file__).resolve().parents[1] / "out"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    stt = words_model(tmp_path_factory.mktemp("web-agent-stt"))
    log = tmp_path_factory.mktemp("web-agent-server") / "serve.log"
    # 48 tokens: room for a forced call's arguments, and a spoken reply of a few seconds
    args = ["--hf-repo", str(stt.root), "--tts", "demo-tts", "--tts-temperature", "0", "--llm", "demo",
            "--llm-max-tokens", "48", "--webrtc-hosts", "127.0.0.1"]  # fmt: skip
    with running_server(log, *args) as live:
        yield live
    assert "Traceback" not in log.read_text(), log.read_text()[-5000:]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    mic = tmp_path_factory.mktemp("agent-mic")
    pcm, _ = compose([2.5, speak("Please call me back tomorrow morning.", mic), 30.0], seed=5)
    wav = mic / "mic.wav"
    write_wav(str(wav), pcm)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=launch_args(wav))
        yield b
        b.close()


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    yield page
    context.close()
    assert not errors, errors


def save(page, tmp_path: Path, name: str) -> None:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    OUT.mkdir(exist_ok=True)
    shutil.copy(shot, OUT / name)


def open_page(server, page, query: str) -> None:
    page.goto(f"{server.url}/?{query}")
    page.wait_for_selector("#agent:not([hidden])", timeout=10000)  # /v1/models lists a voice agent


def shown(page) -> str:
    """What the page shows, for a failure: its state, its message, and each conversation line."""
    return page.evaluate(
        """() => [document.getElementById("state").textContent, document.getElementById("message").textContent,
                  ...[...document.querySelectorAll("#conversation li")].map(
                    (li) => `${li.dataset.role}/${li.dataset.state}: ${li.textContent}`)].join("\\n")"""
    )


def reply_after(page, role: str, text: str | None = None, timeout: float = 120000) -> None:
    """Wait for an agent's line with text after the first conversation line of `role` (and `text`, if given)."""
    try:
        page.wait_for_function(
            """([role, text]) => {
              const lines = [...document.querySelectorAll("#conversation li")];
              const at = lines.findIndex(
                (li) => li.dataset.role === role && (text === null || li.textContent === text));
              const said = (li) => li.dataset.role === "assistant" && /\\S/.test(li.textContent);
              return at >= 0 && lines.slice(at + 1).some(said);
            }""",
            arg=[role, text],
            timeout=timeout,
        )
    except sync_api.TimeoutError:
        raise AssertionError(f"no reply with text after the {role} line; the page shows:\n{shown(page)}") from None


@pytest.mark.parametrize("transport", ["websocket", "auto"])
def test_a_spoken_turn_a_forced_tool_call_answered_by_the_page_and_a_spoken_reply(server, page, tmp_path, transport):
    """Over the WebSocket, and over a WebRTC call (auto: /v1/models lists calls for the agent): the same events, on
    the socket or on the call's oai-events channel; the speech as audio events, or on the call's track."""
    open_page(server, page, f"tool_choice=required&interrupt=0&transport={transport}")
    assert page.is_hidden("#model-says") and page.is_hidden("#you") and page.is_visible("#conversation-box")
    assert page.input_value("#tool_choice") == "required" and page.is_checked("#offer_tool")
    page.click("#start")
    page.wait_for_selector("#state[data-state=live]", timeout=20000)
    assert ("WebRTC" in page.inner_text("#state")) == (transport == "auto")
    used = "tools: set_volume (required); barge-in off"  # the server took the page's session.update
    page.wait_for_function(f"document.getElementById('agent-used').textContent === '{used}'", timeout=10000)

    user = page.wait_for_selector("#conversation li[data-role=user][data-state=done]", timeout=60000)
    assert user is not None
    heard = user.inner_text()
    assert heard and heard != "(no words)" and "…" not in heard

    page.wait_for_selector("#conversation li[data-role=tool][data-state=answered]", timeout=60000)
    # The page's function_call_output and response.create: the agent answers, and the answer plays.
    reply_after(page, "tool")
    schema = page.evaluate("import('./agent.js').then((m) => m.SET_VOLUME.parameters)")
    calls, volume = page.evaluate(  # at one moment: the calls answered so far (the LLM may make several)
        """() => [[...document.querySelectorAll("#conversation li[data-role=tool][data-state=answered]")]
                   .map((li) => [li.dataset.name, li.dataset.arguments, li.dataset.output]),
                  document.getElementById("volume").value]"""
    )
    for name, arguments, output in calls:
        assert name == "set_volume"
        jsonschema.validate(json.loads(arguments), schema)
        assert json.loads(output) == {"volume": json.loads(arguments)["level"]}
    assert volume == str(json.loads(calls[-1][1])["level"])  # the page did what the last call asked
    if transport == "websocket":  # the page's player has played it
        page.wait_for_function("Number(document.getElementById('played').textContent) >= 400", timeout=30000)
    else:  # output_audio_buffer.started, and the call's track is loud
        page.wait_for_function("document.getElementById('first-audio').textContent.endsWith('ms')", timeout=10000)
        page.wait_for_function("parseFloat(document.getElementById('out-level').style.width) > 0", timeout=10000)
        assert page.inner_text("#frames-received") == "0"  # no audio event: the speech is on the track
    roles = page.eval_on_selector_all("#conversation li", "(lines) => lines.map((li) => li.dataset.role)")
    assert roles.index("user") < roles.index("tool") < roles.index("assistant"), roles
    assert page.is_hidden("#message")  # no error shown
    save(page, tmp_path, f"web-agent-{transport}.png")
    page.click("#stop")
    page.wait_for_selector("#state[data-state=idle]")


def test_settings_from_the_address_reach_the_agent_and_a_typed_turn_is_answered(server, page):
    """Instructions and no tool, from the page's address: the session the server answers with has them, and a change
    during the session is sent at once. A typed turn is answered in words. A preset that is not one of a setting's
    choices is refused in words."""
    open_page(server, page, "tool_choice=maybe")
    page.wait_for_selector("#message:not([hidden])", timeout=5000)
    assert 'tool_choice to "maybe"' in page.inner_text("#message")
    assert page.input_value("#tool_choice") == "auto"

    open_page(server, page, "offer_tool=0&interrupt=0&instructions=Answer+in+one+short+sentence.&transport=websocket")
    assert not page.is_checked("#offer_tool") and page.is_hidden("#message")
    page.click("#start")
    used = "document.getElementById('agent-used')"
    page.wait_for_function(f"{used}.textContent === 'tools: none; barge-in off'", timeout=15000)
    assert page.get_attribute("#agent-used", "title") == "Answer in one short sentence."

    page.fill("#typed", "Say hello.")
    page.press("#typed", "Enter")
    reply_after(page, "user", "Say hello.")

    page.check("#offer_tool")
    page.wait_for_function(f"{used}.textContent === 'tools: set_volume (auto); barge-in off'", timeout=10000)
    page.click("#stop")
    page.wait_for_selector("#state[data-state=idle]")
    assert page.is_hidden("#message")


VIEW = """async (events) => {
  const { AgentView } = await import("./agent.js");
  const list = document.createElement("ol");
  const seen = { sent: [], flushed: 0, volume: null, caller: [] };
  const view = new AgentView(list, {
    send: (text) => seen.sent.push(JSON.parse(text)), setVolume: (level) => { seen.volume = level; },
    flush: () => { seen.flushed += 1; }, fail: () => {}, session: () => {},
  });
  for (const event of events) if (!view.onEvent(event)) seen.caller.push(event.type);
  seen.lines = [...list.children].map((li) => ({ ...li.dataset, text: li.textContent, title: li.title }));
  return seen;
}"""


def message(status: str, transcript: str | None = None) -> dict:
    content = [] if transcript is None else [{"type": "output_audio", "transcript": transcript}]
    return {"id": "item_a", "type": "message", "role": "assistant", "status": status, "content": content}


def test_a_reply_cut_by_a_barge_in_is_flushed_and_shown_cut_off(server, page):
    """The page's view (agent.js, in the browser) of what a barge-in brings, as the server sends it (its side:
    test_agent_realtime's barge-in test): `speech_started` while a reply speaks flushes the speech queued (not once
    the reply is done), the caller still captions it, and the reply's item, `incomplete` with the words heard, is
    shown cut off. Fed as events: the demo STT's words in silence cut a live reply before it speaks, not on cue."""
    page.goto(f"{server.url}/")
    delta = "response.output_audio_transcript.delta"
    added = {"type": "response.output_item.added", "response_id": "resp_a", "output_index": 0}
    events = [
        {**added, "item": message("in_progress")},
        *({"type": delta, "response_id": "resp_a", "item_id": "item_a", "delta": d} for d in ("Once", " upon", " a")),
        {"type": "input_audio_buffer.speech_started", "item_id": "item_u", "audio_start_ms": 0},
        {"type": "response.output_item.done", "response_id": "resp_a", "output_index": 0,
         "item": message("incomplete", "Once upon")},
        {"type": "response.done", "response": {"id": "resp_a", "status": "cancelled", "output": []}},
        {"type": "input_audio_buffer.speech_started", "item_id": "item_v", "audio_start_ms": 0},
    ]  # fmt: skip
    seen = page.evaluate(VIEW, events)
    assert seen["flushed"] == 1 and seen["caller"] == ["input_audio_buffer.speech_started"] * 2
    (line,) = seen["lines"]
    assert line["role"] == "assistant" and line["state"] == "truncated" and line["text"] == "Once upon"
    assert line["title"] == "cut off: the rest was not said" and seen["sent"] == []


def test_a_call_is_answered_and_followed_up_only_when_its_response_was_not_cancelled(server, page):
    """A completed call is answered at once; the follow-up `response.create` (tool_choice none) waits for its
    response's end and is not sent when that response was cancelled (the user's next turn answers the output). A
    call cut short is shown, not made; an argument out of the tool's range is answered with an error."""
    page.goto(f"{server.url}/")

    def call(item_id: str, response: str, arguments: str, status: str = "completed") -> list[dict]:
        item = {"id": item_id, "type": "function_call", "call_id": f"call_{item_id}", "name": "set_volume"}
        return [
            {"type": "response.output_item.added", "response_id": response, "output_index": 0,
             "item": {**item, "status": "in_progress", "arguments": ""}},
            {"type": "response.function_call_arguments.delta", "response_id": response, "item_id": item_id,
             "call_id": item["call_id"], "delta": arguments},
            {"type": "response.output_item.done", "response_id": response, "output_index": 0,
             "item": {**item, "status": status, "arguments": arguments}},
        ]  # fmt: skip

    events = [
        *call("item_1", "resp_1", '{"level": 4}'),
        {"type": "response.done", "response": {"id": "resp_1", "status": "completed"}},
        *call("item_2", "resp_2", '{"level": 3}'),
        {"type": "response.done", "response": {"id": "resp_2", "status": "cancelled"}},
        *call("item_3", "resp_3", '{"level": 11}'),
        *call("item_4", "resp_3", '{"lev', "incomplete"),
        {"type": "response.done", "response": {"id": "resp_3", "status": "incomplete"}},
    ]
    seen = page.evaluate(VIEW, events)
    outputs = [(e["item"]["call_id"], json.loads(e["item"]["output"])) for e in seen["sent"] if "item" in e]
    assert outputs == [
        ("call_item_1", {"volume": 4}),
        ("call_item_2", {"volume": 3}),
        ("call_item_3", {"error": "level must be an integer from 0 to 10"}),
    ]
    follow_ups = [e for e in seen["sent"] if e["type"] == "response.create"]
    assert follow_ups == [{"type": "response.create", "response": {"tool_choice": "none"}}] * 2  # resp_1, resp_3
    assert [e["type"] for e in seen["sent"]].index("response.create") == 1  # resp_1's, after its output
    assert seen["volume"] == 3 and [line["state"] for line in seen["lines"]] == ["answered"] * 3 + ["incomplete"]
    assert "not called" in seen["lines"][3]["text"]
