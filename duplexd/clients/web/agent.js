// The page as a voice agent's client (a server with --llm: /v1/models lists a "voice-agent"). It reads the same
// Realtime events whichever transport carries them (the WebSocket or a call's oai-events channel), so nothing here
// knows which: one conversation list of the user's transcript, the agent's words (a reply cut by the user's barge-in
// shown as cut off) and the tool calls with the output the page answered. The page has one tool of its own,
// set_volume, so a call makes a visible round trip: the call, the page's function_call_output, then a
// response.create for the agent to answer in words.

export const SET_VOLUME = {
  type: "function",
  name: "set_volume",
  description: "Set how loud the assistant's voice plays on the user's speaker, from 0 (silent) to 10 (full).",
  parameters: {
    type: "object",
    properties: { level: { type: "integer", minimum: 0, maximum: 10, description: "0 silent, 10 full" } },
    required: ["level"],
  },
};

/** The session.update that sets the agent up as the page's settings say. */
export function agentUpdate({ instructions, voice, offerTool, toolChoice, interrupt }) {
  const session = {
    type: "realtime",
    tools: offerTool ? [SET_VOLUME] : [],
    tool_choice: offerTool ? toolChoice : "auto",
    // the server's own turn detection; barge-in off suits a speaker the microphone hears, or an STT that hears
    // words in silence (the demo's)
    audio: { input: { turn_detection: { type: "server_vad", interrupt_response: interrupt } } },
  };
  if (instructions.trim()) session.instructions = instructions; // empty: the server's own
  if (voice) session.audio.output = { voice };
  return JSON.stringify({ type: "session.update", session });
}

/** What the page's tool answers, as the function_call_output's text: an error names what was wrong. */
export function answerCall(name, argumentsText, setVolume) {
  if (name !== SET_VOLUME.name) return { error: `this page has no tool named ${name}` };
  let args;
  try {
    args = JSON.parse(argumentsText || "{}");
  } catch (e) {
    return { error: "the arguments are not JSON" };
  }
  const level = args && args.level;
  if (!Number.isInteger(level) || level < 0 || level > 10) return { error: "level must be an integer from 0 to 10" };
  setVolume(level);
  return { volume: level };
}

const FOLLOW_UP = JSON.stringify({ type: "response.create", response: { tool_choice: "none" } });

/** A typed turn: the user's text as a conversation item, then a response to it. */
export function typedTurn(text) {
  const item = { type: "message", role: "user", content: [{ type: "input_text", text }] };
  return [JSON.stringify({ type: "conversation.item.create", item }), JSON.stringify({ type: "response.create" })];
}

/**
 * The conversation as the agent's events tell it, in `list` (one <li> an item, keyed by item id; the user's lines
 * are the page's captions, added there by the caller). `hooks`: send(text), setVolume(level), flush() (drop the
 * speech not yet played: the user cut in), fail(message), session(session).
 */
export class AgentView {
  constructor(list, hooks) {
    this.list = list;
    this.hooks = hooks;
    this.lines = new Map(); // item id → its <li>
    this.answered = new Set(); // responses with a call the page answered: each gets a follow-up response
    this.speaking = null; // the response whose message is under way
  }

  line(itemId, role) {
    let li = this.lines.get(itemId);
    if (!li) {
      li = document.createElement("li");
      li.dataset.item = itemId;
      li.dataset.role = role;
      this.lines.set(itemId, li);
      this.list.appendChild(li);
    }
    this.list.scrollTop = this.list.scrollHeight;
    return li;
  }

  /** Handles `event` when it is the agent's; false for the caller's own (captions, audio, errors). */
  onEvent(event) {
    switch (event.type) {
      case "session.updated":
        this.hooks.session(event.session || {});
        return true;
      case "input_audio_buffer.speech_started":
        if (this.speaking) this.hooks.flush(); // the server cancelled the reply: stop what is still queued
        return false; // the caption is the caller's
      case "conversation.item.added": { // a typed turn (a spoken one is the caller's caption)
        const item = event.item || {};
        const part = (item.content || [])[0] || {};
        if (item.role === "user" && part.type === "input_text") {
          const li = this.line(item.id, "user");
          li.dataset.state = "done";
          li.textContent = part.text;
        }
        return true;
      }
      case "response.created":
        return true;
      case "response.output_item.added":
        this.added(event.response_id, event.item || {});
        return true;
      case "response.output_audio_transcript.delta":
      case "response.output_text.delta":
      case "response.function_call_arguments.delta": {
        const li = this.lines.get(event.item_id);
        if (li) li.textContent += event.delta || "";
        return true;
      }
      case "response.output_item.done":
        this.done(event.response_id, event.item || {});
        return true;
      case "response.done":
        this.finished(event.response || {});
        return true;
      case "error": // the page's follow-up came as the user's turn started a response: that one answers the output
        return (event.error || {}).code === "conversation_already_has_active_response";
      default:
        return false;
    }
  }

  added(responseId, item) {
    if (item.type === "message") {
      this.speaking = responseId;
      this.line(item.id, "assistant").dataset.state = "speaking";
    } else if (item.type === "function_call") {
      const li = this.line(item.id, "tool");
      li.dataset.state = "calling";
      li.dataset.name = item.name;
      li.textContent = `${item.name}(`; // its argument deltas follow
    }
  }

  done(responseId, item) {
    const li = this.lines.get(item.id);
    if (!li) return;
    if (item.type === "message") {
      const part = (item.content || [])[0] || {};
      const heard = part.transcript ?? part.text;
      if (heard) li.textContent = heard; // what was said (for a cut reply: what was heard of it)
      li.dataset.state = item.status === "incomplete" ? "truncated" : "done";
      if (li.dataset.state === "truncated") li.title = "cut off: the rest was not said";
    } else if (item.type === "function_call") {
      li.dataset.arguments = item.arguments || "";
      if (item.status !== "completed") {
        li.dataset.state = "incomplete";
        li.textContent = `${item.name}(${item.arguments || ""}…) not called: its arguments were cut short`;
        return;
      }
      const output = JSON.stringify(answerCall(item.name, item.arguments, this.hooks.setVolume));
      li.dataset.output = output;
      li.dataset.state = "answered";
      li.textContent = `${item.name}(${item.arguments}) → ${output}`;
      this.hooks.send(JSON.stringify({
        type: "conversation.item.create", item: { type: "function_call_output", call_id: item.call_id, output },
      }));
      this.answered.add(responseId);
    }
  }

  finished(response) {
    if (this.speaking === response.id) this.speaking = null;
    if (response.status === "failed") {
      const error = (response.status_details || {}).error || {};
      this.hooks.fail(`The agent could not answer: ${error.message || "its reply failed"}`);
    }
    // A call answered: the agent answers its output in words (tool_choice none, so a forced choice cannot loop).
    // A cancelled response leaves the output in the conversation for the user's next turn.
    if (this.answered.delete(response.id) && response.status !== "cancelled" && response.status !== "failed") {
      this.hooks.send(FOLLOW_UP);
    }
  }
}
