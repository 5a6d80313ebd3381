// duplexd browser voice chat: microphone → the model's voice and text, over WebRTC when the server serves calls
// (/v1/realtime/calls: the browser's own echo cancellation, jitter buffer and Opus), else over the /v1/realtime
// WebSocket (base64 pcm16, 24 kHz: no build step and no codec, AudioWorklets capture and play). Settings can force
// either. Both carry the same Realtime events; a call carries them on its oai-events data channel.
// "Transcribe me" (when the server has a transcription model) turns on input_audio_transcription: the user's
// captions, one line per utterance, from the server's speech_started / speech_stopped / transcription events.
// A PersonaPlex server with voices (/v1/models: persona true) gets a persona box: a role text and a voice picker,
// sent as the text_prompt / voice_prompt query parameters; the server starts the persona before the first audio.
// A voice-agent server (/v1/models: a "voice-agent" model; --llm) gets an agent box (instructions, voice, the page's
// set_volume tool and the tool choice) and one conversation list instead (agent.js: the same over either transport).
// The settings marked data-query can be preset from the page's address: /?tool_choice=required&transport=websocket.

import { AgentView, agentUpdate, typedTurn } from "./agent.js";

const RATE = 24000;
const FRAME = 1920; // 80 ms
const $ = (id) => document.getElementById(id);

const ui = {
  state: $("state"), message: $("message"), demo: $("demo-note"), text: $("text"), start: $("start"),
  stop: $("stop"), inLevel: $("in-level"), outLevel: $("out-level"), frames: $("frames-received"),
  firstAudio: $("first-audio"), buffered: $("buffered"), underruns: $("underruns"), model: $("model-id"),
  transcribe: $("transcribe"), transcribeToggle: $("transcribe-toggle"), you: $("you"), captions: $("captions"),
  persona: $("persona"), voice: $("voice_prompt"), role: $("text_prompt"), personaUsed: $("persona-used"),
  played: $("played"), volume: $("volume"), agent: $("agent"), agentDemo: $("agent-demo-note"),
  instructions: $("instructions"), agentVoice: $("agent_voice"), offerTool: $("offer_tool"), toolChoice: $("tool_choice"),
  interrupt: $("interrupt"),
  conversation: $("conversation"), conversationBox: $("conversation-box"), modelSays: $("model-says"),
  agentUsed: $("agent-used"), say: $("say"), typed: $("typed"), send: $("send"),
};

let chat = null; // the running conversation, if any
let transcriber = null; // the server's transcription model (from /v1/models), if it has one
let callsServed = false; // the server serves WebRTC calls (/v1/models protocols)
let agent = null; // the server's voice agent (/v1/models), when it is one

function setState(state, label) {
  ui.state.className = `state ${state}`;
  ui.state.dataset.state = state;
  ui.state.textContent = label || state;
}

function showMessage(text) {
  ui.message.textContent = text;
  ui.message.hidden = !text;
}

function meter(el, rms) {
  const db = 20 * Math.log10(Math.max(rms, 1e-5)); // -100 .. 0 dBFS, shown from -60
  el.style.width = `${Math.max(0, Math.min(100, ((db + 60) / 60) * 100)).toFixed(0)}%`;
}

function toBase64(int16) {
  const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

function fromBase64(b64) {
  const binary = atob(b64);
  const count = binary.length >> 1;
  const out = new Float32Array(count);
  for (let i = 0; i < count; i++) {
    let v = binary.charCodeAt(2 * i) | (binary.charCodeAt(2 * i + 1) << 8);
    if (v >= 0x8000) v -= 0x10000;
    out[i] = v / 32768;
  }
  return out;
}

function pcm16(frame) {
  const out = new Int16Array(frame.length);
  for (let i = 0; i < frame.length; i++) out[i] = Math.max(-1, Math.min(1, frame[i])) * 32767;
  return out;
}

// ------------------------------------------------------------------------------------------- captions

function transcriptionUpdate(on) {
  const settings = on ? { model: transcriber } : null;
  return JSON.stringify({ type: "session.update", session: { input_audio_transcription: settings } });
}

function caption(c, itemId) {
  let line = c.captions.get(itemId);
  if (!line) {
    line = document.createElement("li");
    line.dataset.item = itemId;
    line.dataset.role = "user";
    c.captions.set(itemId, line);
    c.list.appendChild(line);
  }
  return line;
}

function setCaption(line, state, text, title) {
  line.dataset.state = state;
  line.textContent = text;
  if (title) line.title = title;
  line.parentElement.scrollTop = line.parentElement.scrollHeight;
}

function onTranscriptEvent(c, event) {
  switch (event.type) {
    case "input_audio_buffer.speech_started":
      setCaption(caption(c, event.item_id), "speaking", "… (speaking)");
      break;
    case "input_audio_buffer.speech_stopped": {
      const line = caption(c, event.item_id);
      if (line.dataset.state === "speaking") setCaption(line, "transcribing", "… (transcribing)");
      break;
    }
    case "conversation.item.input_audio_transcription.delta": {
      const line = caption(c, event.item_id);
      const sofar = line.dataset.state === "partial" ? line.textContent : "";
      setCaption(line, "partial", sofar + (event.delta || ""));
      break;
    }
    case "conversation.item.input_audio_transcription.completed":
      setCaption(caption(c, event.item_id), "done", event.transcript || "(no words)");
      break;
    case "conversation.item.input_audio_transcription.failed":
      setCaption(caption(c, event.item_id), "failed", "(transcript failed)", (event.error || {}).message);
      break;
    default:
      return false;
  }
  return true;
}

function settings() {
  const query = new URLSearchParams();
  for (const name of agent ? [] : ["text_temperature", "text_topk", "audio_temperature", "audio_topk", "seed"]) {
    const value = $(name).value.trim();
    if (value !== "") query.set(name, value);
  }
  if (!ui.persona.hidden) {
    query.set("text_prompt", ui.role.value);
    query.set("voice_prompt", ui.voice.value);
  }
  return query;
}

function endpoint(query) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}/v1/realtime?${query}`;
}

const REFUSALS = {
  resource_exhausted: "The server is full: every session slot is in use. Try again in a moment.",
  capacity: "The server is full: every session slot is in use. Try again in a moment.",
  invalid_api_key: "The server refused the API key. Enter the right key under Settings.",
  origin_not_allowed: "The server does not accept connections from this page's origin.",
  invalid_parameter: "The server refused a setting",
  server_draining: "The server is shutting down. Try again in a moment.",
  webrtc_unavailable: "The server cannot take calls: choose WebSocket under Settings.",
  webrtc_off: "The server takes no calls: choose WebSocket under Settings.",
};

function useWebRTC() {
  const choice = $("transport").value;
  return choice === "webrtc" || (choice === "auto" && callsServed);
}

async function start() {
  showMessage("");
  if (!window.isSecureContext || !navigator.mediaDevices) {
    setState("error");
    showMessage("The microphone needs a secure page: open this over https:// (duplexd serve --ssl DIR) or " +
                "on http://localhost.");
    return;
  }
  ui.start.disabled = true;
  ui.stop.disabled = false;
  ui.voice.disabled = ui.role.disabled = true;
  ui.text.textContent = "";
  ui.captions.textContent = "";
  ui.conversation.textContent = "";
  ui.frames.textContent = "0";
  ui.played.textContent = "0";
  ui.firstAudio.textContent = "–";
  setState("connecting", "opening microphone");
  const c = { userClosed: false, admitted: false, frames: 0, sentAt: null, closeInfo: null, captions: new Map() };
  c.list = agent ? ui.conversation : ui.captions;
  c.agent = agent ? new AgentView(ui.conversation, agentHooks(c)) : null;
  chat = c;
  try {
    c.context = new AudioContext({ sampleRate: RATE, latencyHint: "interactive" });
    await c.context.audioWorklet.addModule("capture-worklet.js");
    await c.context.audioWorklet.addModule("player-worklet.js");
    c.stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
  } catch (e) {
    stop(`Cannot open the microphone: ${e.message || e}`, "error");
    return;
  }
  const prebuffer = Math.round((Number($("jitter_ms").value) || 160) * RATE / 1000);
  c.player = new AudioWorkletNode(c.context, "player-processor",
                                  { outputChannelCount: [1], processorOptions: { prebuffer, maxBuffer: RATE } });
  c.gain = new GainNode(c.context, { gain: volume() });
  c.player.connect(c.gain).connect(c.context.destination);
  c.player.port.onmessage = (e) => {
    if (chat !== c) return;
    meter(ui.outLevel, e.data.level);
    ui.played.textContent = Math.round((e.data.played * 1000) / RATE);
    ui.buffered.textContent = Math.round((e.data.buffered * 1000) / RATE);
    ui.underruns.textContent = e.data.underruns;
  };
  c.capture = new AudioWorkletNode(c.context, "capture-processor",
                                   { numberOfOutputs: 0, processorOptions: { frameSize: FRAME } });
  c.source = c.context.createMediaStreamSource(c.stream);
  c.source.connect(c.capture);
  c.capture.port.onmessage = (e) => {
    if (chat !== c) return;
    meter(ui.inLevel, e.data.level);
    if (c.ws && c.admitted && c.ws.readyState === WebSocket.OPEN) {
      c.ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: toBase64(pcm16(e.data.frame)) }));
      if (c.sentAt === null) c.sentAt = performance.now();
    }
  };
  await c.context.resume();
  if (useWebRTC()) {
    await call(c, settings());
    return;
  }

  setState("connecting", "connecting");
  c.send = (text) => { if (c.ws.readyState === WebSocket.OPEN) c.ws.send(text); };
  const protocols = ["realtime"];
  const key = $("api_key").value.trim();
  if (key) protocols.push(`openai-insecure-api-key.${key}`);
  c.ws = new WebSocket(endpoint(settings()), protocols);
  c.ws.onopen = () => { if (chat === c) setState("waiting", "waiting for a session"); };
  c.ws.onmessage = (e) => onEvent(c, JSON.parse(e.data));
  c.ws.onclose = (e) => onClose(c, e);
}

// A WebRTC call: the microphone on the peer connection, the model's voice from its track, events on oai-events.
async function call(c, query) {
  setState("connecting", "calling");
  const pc = (c.pc = new RTCPeerConnection());
  c.stream.getAudioTracks().forEach((track) => pc.addTrack(track, c.stream));
  const channel = (c.channel = pc.createDataChannel("oai-events"));
  c.send = (text) => { if (channel.readyState === "open") channel.send(text); };
  channel.onmessage = (e) => onEvent(c, JSON.parse(e.data));
  channel.onclose = () => onClose(c, { code: c.admitted ? 1000 : 1006, reason: "the call ended" });
  c.audio = new Audio();
  c.audio.autoplay = true;
  c.audio.volume = volume();
  pc.ontrack = (e) => {
    c.audio.srcObject = e.streams[0];
    const analyser = c.context.createAnalyser();
    c.context.createMediaStreamSource(e.streams[0]).connect(analyser);
    const samples = new Float32Array(analyser.fftSize);
    c.outMeter = setInterval(() => {
      analyser.getFloatTimeDomainData(samples);
      meter(ui.outLevel, Math.sqrt(samples.reduce((sum, v) => sum + v * v, 0) / samples.length));
    }, 100);
  };
  pc.onconnectionstatechange = () => {
    if (pc.connectionState === "failed") onClose(c, { code: 1006, reason: "the call's connection failed" });
  };
  await pc.setLocalDescription(await pc.createOffer());
  const headers = { "Content-Type": "application/sdp" };
  const key = $("api_key").value.trim();
  if (key) headers.Authorization = `Bearer ${key}`;
  let response;
  try {
    response = await fetch(`v1/realtime/calls?${query}`, { method: "POST", body: pc.localDescription.sdp, headers });
  } catch (e) {
    stop(`Cannot reach the server: ${e.message || e}`, "error");
    return;
  }
  if (chat !== c) return;
  if (response.status !== 201) {
    let err = {};
    try { err = (await response.json()).error || {}; } catch (e) { /* not JSON */ }
    const known = REFUSALS[err.code === "capacity" ? "resource_exhausted" : err.code];
    stop(known ? `${known}${err.code === "invalid_parameter" ? `: ${err.message}` : ""}`
               : `The server refused the call (${response.status}): ${err.message || response.statusText}`, "refused");
    return;
  }
  await pc.setRemoteDescription({ type: "answer", sdp: await response.text() });
  if (chat === c) setState("waiting", "waiting for a session");
}

// The first event of a call: the server takes the microphone from it on, so the persona and transcription it sets
// apply to all of it (on the WebSocket the persona travels in the query).
function firstUpdate() {
  const session = {};
  if (!ui.persona.hidden) Object.assign(session, { instructions: ui.role.value, voice: ui.voice.value });
  if (transcriber && ui.transcribe.checked) session.input_audio_transcription = { model: transcriber };
  return JSON.stringify({ type: "session.update", session });
}

// The agent's settings, sent when its session starts and again whenever they change.
function agentSettings() {
  return agentUpdate({ instructions: ui.instructions.value, voice: ui.agentVoice.value, offerTool: ui.offerTool.checked,
                       toolChoice: ui.toolChoice.value, interrupt: ui.interrupt.checked });
}

function agentHooks(c) {
  return {
    send: (text) => c.send(text),
    setVolume,
    flush: () => c.player.port.postMessage({ reset: true }),
    fail: showMessage,
    session: (session) => {
      const tools = (session.tools || []).map((t) => t.name);
      const detection = ((session.audio || {}).input || {}).turn_detection || {};
      ui.agentUsed.textContent = `tools: ${tools.join(", ") || "none"}${tools.length ? ` (${session.tool_choice})` : ""}` +
        (detection.interrupt_response === false ? "; barge-in off" : "");
      ui.agentUsed.title = session.instructions || "";
    },
  };
}

function onEvent(c, event) {
  if (chat !== c) return;
  if (c.agent && c.agent.onEvent(event)) return;
  if (onTranscriptEvent(c, event)) return;
  switch (event.type) {
    case "session.created":
      c.admitted = true;
      c.createdAt = performance.now();
      setState("live", c.pc ? "live (WebRTC)" : "live");
      if (event.session && event.session.model) ui.model.textContent = `model ${event.session.model}`;
      showPersona(event.session || {});
      if (c.agent) {
        c.send(agentSettings());
        ui.typed.disabled = ui.send.disabled = false;
      } else if (c.pc) c.send(firstUpdate());
      else if (transcriber && ui.transcribe.checked) c.send(transcriptionUpdate(true));
      break;
    case "session.updated":
      showPersona(event.session || {});
      break;
    case "output_audio_buffer.started": // a call: the model's voice is on the track from now on
      ui.firstAudio.textContent = `${Math.round(performance.now() - c.createdAt)} ms`;
      break;
    case "response.output_audio.delta":
    case "response.audio.delta": {
      const pcm = fromBase64(event.delta || "");
      c.player.port.postMessage(pcm, [pcm.buffer]);
      c.frames += 1;
      ui.frames.textContent = String(c.frames);
      if (c.frames === 1 && c.sentAt !== null) ui.firstAudio.textContent = `${Math.round(performance.now() - c.sentAt)} ms`;
      break;
    }
    case "response.output_audio_transcript.delta":
    case "response.audio_transcript.delta":
      ui.text.textContent += event.delta || "";
      ui.text.scrollTop = ui.text.scrollHeight;
      break;
    case "error": {
      const err = event.error || {};
      const transcription = (err.param || "").includes("transcription") || (err.code || "").startsWith("transcri");
      if (c.admitted && transcription) { // non-fatal: the conversation goes on, untranscribed
        showMessage(`No transcription: ${err.message}`);
        break;
      }
      const known = REFUSALS[err.code];
      c.closeInfo = known ? `${known}${err.code === "invalid_parameter" ? `: ${err.message}` : ""}`
                          : `Server error (${err.code}): ${err.message}`;
      if (!c.admitted || !known) showMessage(c.closeInfo);
      break;
    }
    default:
      break;
  }
}

function onClose(c, e) {
  if (chat !== c) return;
  if (c.userClosed) return;
  let text;
  if (!c.admitted) {
    text = c.closeInfo || (e.code === 1013 ? REFUSALS.resource_exhausted
      : `The server refused the session (close ${e.code}${e.reason ? `: ${e.reason}` : ""}).`);
    stop(text, "refused");
  } else if (e.code === 1000) {
    stop(`The session ended: ${e.reason || "closed by the server"}.`, "idle");
  } else {
    text = `Connection lost (close ${e.code}${e.reason ? `: ${e.reason}` : ""}). Press Start to reconnect.`;
    stop(text, "lost");
  }
}

function stop(message, state) {
  const c = chat;
  chat = null;
  if (c) {
    c.userClosed = true;
    if (c.ws && c.ws.readyState <= WebSocket.OPEN) c.ws.close(1000, "user stopped");
    if (c.outMeter) clearInterval(c.outMeter);
    if (c.channel) c.channel.close();
    if (c.pc) c.pc.close(); // the server hears the hang-up at once
    if (c.audio) c.audio.srcObject = null;
    if (c.stream) c.stream.getTracks().forEach((t) => t.stop());
    if (c.context) c.context.close();
  }
  ui.start.disabled = false;
  ui.stop.disabled = true;
  ui.voice.disabled = ui.role.disabled = false;
  ui.typed.disabled = ui.send.disabled = true;
  meter(ui.inLevel, 0);
  meter(ui.outLevel, 0);
  setState(state || "idle", state === "lost" ? "connection lost" : state);
  if (message) showMessage(message);
}

function showPersona(session) {
  ui.personaUsed.textContent = session.voice ? `persona: voice ${session.voice}` : "";
  ui.personaUsed.title = session.instructions || "";
}

function setUpPersona(model) {
  const voices = model.persona ? model.voices || [] : [];
  ui.persona.hidden = voices.length === 0;
  if (ui.persona.hidden) return;
  const defaults = model.persona_defaults || {};
  ui.voice.replaceChildren(...voices.map((name) => new Option(name, name)));
  ui.voice.value = voices.includes(defaults.voice_prompt) ? defaults.voice_prompt : voices[0];
  if (!ui.role.value) ui.role.value = defaults.text_prompt || "";
}

function volume() {
  return Number(ui.volume.value) / 10;
}

function setVolume(level) {
  ui.volume.value = String(level);
  applyVolume();
}

function applyVolume() {
  if (chat && chat.gain) chat.gain.gain.value = volume();
  if (chat && chat.audio) chat.audio.volume = volume();
}

function setUpAgent(model, models) {
  agent = model;
  ui.agent.hidden = ui.conversationBox.hidden = false;
  ui.modelSays.hidden = ui.you.hidden = ui.transcribeToggle.hidden = true; // the agent transcribes the user itself
  document.querySelectorAll(".moshi-only").forEach((el) => { el.hidden = true; });
  const voices = model.voices || [];
  const tts = models.find((m) => m.id === model.speaks_with) || {};
  ui.agentVoice.replaceChildren(...voices.map((name) => new Option(name, name)));
  if (voices.includes(tts.default_voice)) ui.agentVoice.value = tts.default_voice;
  const stt = models.find((m) => m.id === model.hears_with) || {};
  const demo = [stt.demo && "STT", tts.demo && "TTS", (model.llm || {}).demo && "LLM"].filter(Boolean);
  ui.agentDemo.hidden = demo.length === 0;
  ui.agentDemo.textContent = `This agent runs demo models (${demo.join(", ")}): ` +
    [(model.llm || {}).demo && "the demo LLM (SmolLM2-135M) answers in real words, briefly and not always to the point",
     tts.demo && "the demo TTS says them as noise",
     stt.demo && "the demo STT has learnt nothing and may hear no turn by itself: type one under the conversation"]
      .filter(Boolean).join("; ") + ".";
  ui.model.textContent = `agent ${model.id}`;
  callsServed = [...(model.protocols || []), ...(model.endpoints || [])].includes("/v1/realtime/calls");
}

// Settings given in the page's address (their data-query names), once the server's voices are known.
function presetFromAddress() {
  const given = new URLSearchParams(location.search);
  for (const el of document.querySelectorAll("[data-query]")) {
    const value = given.get(el.dataset.query);
    if (value === null) continue;
    if (el.type === "checkbox") {
      el.checked = !["0", "false", "off", "no"].includes(value.toLowerCase());
    } else if (el.tagName === "SELECT" && ![...el.options].some((o) => o.value === value)) {
      showMessage(`The page's address sets ${el.dataset.query} to "${value}": not one of ` +
                  `${[...el.options].map((o) => o.value).join(", ") || "its choices"}.`);
    } else {
      el.value = value;
    }
  }
}

async function describeServer() {
  try {
    const response = await fetch("v1/models");
    if (response.status === 401) {
      $("settings").open = true;
      showMessage("This server needs an API key: enter it under Settings.");
      return;
    }
    const body = await response.json();
    const models = body.data || [];
    const voiceAgent = models.find((m) => m.task === "voice-agent");
    if (voiceAgent) {
      setUpAgent(voiceAgent, models);
      return;
    }
    const model = models.find((m) => m.task !== "transcription");
    callsServed = Boolean(model && (model.protocols || []).includes("/v1/realtime/calls"));
    if (model) {
      ui.demo.hidden = !model.demo;
      ui.model.textContent = `model ${model.id}`;
      setUpPersona(model);
    }
    const asr = models.find((m) => m.task === "transcription");
    transcriber = asr ? asr.id : null;
    ui.transcribeToggle.hidden = !asr;
    ui.transcribe.checked = Boolean(asr);
    ui.you.hidden = !asr;
  } catch (e) {
    showMessage(`Cannot reach the server: ${e.message || e}`);
  }
}

ui.start.addEventListener("click", start);
ui.transcribe.addEventListener("change", () => {
  ui.you.hidden = !ui.transcribe.checked;
  if (chat && chat.admitted) chat.send(transcriptionUpdate(ui.transcribe.checked));
});
ui.stop.addEventListener("click", () => stop("", "idle"));
ui.volume.addEventListener("input", applyVolume);
ui.say.addEventListener("submit", (e) => {
  e.preventDefault();
  const text = ui.typed.value.trim();
  if (!text || !chat || !chat.admitted || !chat.agent) return;
  typedTurn(text).forEach((event) => chat.send(event));
  ui.typed.value = "";
});
for (const el of [ui.instructions, ui.agentVoice, ui.offerTool, ui.toolChoice, ui.interrupt]) {
  el.addEventListener("change", () => { if (chat && chat.admitted && chat.agent) chat.send(agentSettings()); });
}
describeServer().then(presetFromAddress);
