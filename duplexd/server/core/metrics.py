"""Prometheus metrics: one registry per app (so several apps in one process never collide).

Engine counters and gauges are read from `Engine.stats()` at scrape time; step duration and batch size come from
the engine's step callback and dropped frames from its drop callback (prometheus-client is thread-safe);
per-session counters are fed by the connections, and the connection counts by the front door (`server.front_door`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from duplexd.engine.dialogue.engine import StepRecord

from .runtime import Runtime

STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.1, 0.15, 0.2, 0.5, 1.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
TRANSCRIPT_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
LATENCY_BUCKETS = (0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)


class _EngineCollector(Collector):
    """Gauges and engine-wide counters, read from the engines when Prometheus scrapes."""

    def __init__(self, runtime: Runtime, draining: Callable[[], bool]) -> None:
        self.runtime, self.draining = runtime, draining

    def collect(self) -> Iterable:
        stats = self.runtime.stats()
        gauges = {
            "duplexd_sessions_active": ("sessions holding a slot", sum(s.active_sessions for s in stats)),
            "duplexd_sessions_capacity": ("session slots", sum(s.max_sessions for s in stats)),
            "duplexd_sessions_admissible": ("sessions that could be admitted now", self.runtime.admissible()),
            "duplexd_kv_pages_used": ("KV cache pages in use", sum(s.kv_pages_used for s in stats)),
            "duplexd_kv_pages_total": ("KV cache pages", sum(s.kv_pages_total for s in stats)),
            "duplexd_ready": ("1 once every engine is warm", int(self.runtime.ready)),
            "duplexd_draining": ("1 from SIGTERM/SIGINT until exit: new sessions refused", int(self.draining())),
        }
        service = self.runtime.transcription
        if service is not None:
            t = service.stats()
            gauges["duplexd_transcription_streams"] = ("sessions being transcribed", t.streams)
            gauges["duplexd_transcription_streams_capacity"] = (
                "sessions that can be transcribed at once",
                t.max_streams,
            )
            gauges["duplexd_transcription_queue_depth"] = ("finished utterances waiting for the decoder", t.queued)
            gauges["duplexd_transcription_speaking"] = ("transcribed sessions in an utterance now", t.speaking)
        speech = self.runtime.speech
        if speech is not None:
            gauges["duplexd_tts_streams"] = ("speech streams holding a slot", speech.service.used_streams)
            gauges["duplexd_tts_streams_capacity"] = ("speech stream slots", speech.service.max_streams)
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "duplexd_engine_steps": ("engine steps", sum(s.steps for s in stats)),
            "duplexd_frames_in": ("80 ms frames the engine consumed", sum(s.frames_in for s in stats)),
            "duplexd_frames_out": ("80 ms frames the engine produced", sum(s.frames_out for s in stats)),
            "duplexd_prompt_frames": ("persona prompt frames prefilled", sum(s.prompt_frames for s in stats)),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, runtime: Runtime, draining: Callable[[], bool] = lambda: False) -> None:
        self.registry = registry = CollectorRegistry()
        registry.register(_EngineCollector(runtime, draining))
        # process_resident_memory_bytes, CPU seconds, open fds (Linux): what a soak run watches for leaks
        ProcessCollector(registry=registry)
        self.sessions = Counter("duplexd_sessions", "sessions admitted", ["protocol"], registry=registry)
        self.refused = Counter("duplexd_sessions_refused", "sessions refused", ["reason"], registry=registry)
        self.closed = Counter("duplexd_sessions_closed", "sessions ended", ["reason"], registry=registry)
        self.protocol_errors = Counter(
            "duplexd_protocol_errors", "connections ended by bad input", ["protocol", "error"], registry=registry
        )
        self.dropped = Counter(
            "duplexd_frames_dropped",
            "frames dropped: input over the inbox bound, output over the outbox bound",
            ["direction"],
            registry=registry,
        )
        self.late = Counter(
            "duplexd_frames_late", "output frames later than the late threshold after their input", registry=registry
        )
        self.latency = Histogram(
            "duplexd_frame_latency_seconds",
            "input frame pushed to its output frame received",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.step_seconds = Histogram(
            "duplexd_step_duration_seconds", "engine step duration", buckets=STEP_BUCKETS, registry=registry
        )
        self.speech_step_seconds = Histogram(
            "duplexd_tts_step_duration_seconds", "text-to-speech step duration", buckets=STEP_BUCKETS, registry=registry
        )
        self.batch_size = Histogram(
            "duplexd_step_batch_size", "sessions per engine step", buckets=BATCH_BUCKETS, registry=registry
        )
        self.transcripts = Counter(
            "duplexd_transcripts", "utterances transcribed, by outcome", ["outcome"], registry=registry
        )
        self.transcript_seconds = Histogram(
            "duplexd_time_to_transcript_seconds",
            "end of speech to the transcript (or its failure)",
            buckets=TRANSCRIPT_BUCKETS,
            registry=registry,
        )
        self.agent_reply_seconds = Histogram(
            "duplexd_agent_reply_seconds",
            "a voice agent's reply, part by part: wait (for the turn's transcript), llm (to its first token), words "
            "(to the first whole word), tts (to the first speech)",
            ["stage"],
            buckets=TRANSCRIPT_BUCKETS,
            registry=registry,
        )
        self.prompt_seconds = Histogram(
            "duplexd_prompt_seconds",
            "a persona prompt's start to its session going live (the prefill, beside live sessions)",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.file_transcriptions = Counter(
            "duplexd_file_transcriptions",
            "POST /v1/audio/transcriptions requests, by outcome: completed or the error code",
            ["outcome"],
            registry=registry,
        )
        self.connections_open = Gauge(
            "duplexd_connections_open",
            "TCP connections open: HTTP, WebSocket, or over a cap and being refused",
            registry=registry,
        )
        self.connections_refused = Counter(
            "duplexd_connections_refused",
            "connections over --max-connections-per-ip (per_ip) or --max-connections (total), answered 503 or closed",
            ["reason"],
            registry=registry,
        )
        self.connections_timed_out = Counter(
            "duplexd_connections_timed_out",
            "connections closed because their request head was not complete within --header-timeout",
            registry=registry,
        )
        for direction in ("in", "out"):
            self.dropped.labels(direction)
        for reason in ("per_ip", "total"):
            self.connections_refused.labels(reason)
        for outcome in ("completed", "failed"):
            self.transcripts.labels(outcome)

    def on_step(self, record: StepRecord) -> None:
        """Engine-thread callback after every step."""
        self.step_seconds.observe(record.seconds)
        self.batch_size.observe(record.batch_size)

    def on_speech_step(self, seconds: float, streams: int) -> None:
        """Speech-service callback after every text-to-speech step."""
        self.speech_step_seconds.observe(seconds)

    def on_dropped(self, direction: str, count: int) -> None:
        """Engine callback when frames are dropped at a session's inbox ("in") or outbox ("out") bound."""
        self.dropped.labels(direction).inc(count)

    def on_transcript(self, outcome: str, seconds: float) -> None:
        """Transcription callback for every utterance ended: "completed" or "failed", end of speech to result."""
        self.transcripts.labels(outcome).inc()
        self.transcript_seconds.observe(seconds)

    def on_agent_reply(self, stages: dict[str, float]) -> None:
        for stage, seconds in stages.items():
            self.agent_reply_seconds.labels(stage).observe(seconds)

    def subscribe(self, runtime: Runtime) -> Callable[[], None]:
        stops = [engine.on_step(self.on_step) for engine in runtime.engines]
        stops += [engine.on_dropped(self.on_dropped) for engine in runtime.engines]
        stops += [engine.on_prompted(self.prompt_seconds.observe) for engine in runtime.engines]
        if runtime.transcription is not None:
            stops.append(runtime.transcription.on_transcript(self.on_transcript))
        if runtime.speech is not None:
            stops.append(runtime.speech.service.on_step.add(self.on_speech_step))

        def unsubscribe() -> None:
            for stop in stops:
                stop()

        return unsubscribe

    def render(self) -> bytes:
        return generate_latest(self.registry)
