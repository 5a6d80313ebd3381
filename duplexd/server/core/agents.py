"""The LLM a server's voice agents ask (`--llm`): where it is, the client every agent session shares, and the demo
server duplexd starts for `--llm demo`.

A voice agent hears through the main model, which must be a Kyutai STT model (its words and pause heads), and
speaks through `--tts`; both are checked at start-up, naming the option. The demo server (llama.cpp with
SmolLM2-135M) serves `max_sessions` requests at once, each with its share of a context of 2048 tokens a request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from duplexd.engine.agent.demo_llm import DemoLLM, DemoLLMConfig, start_demo_llm
from duplexd.engine.agent.llm import LLMClient, LLMConfig
from duplexd.engine.errors import InputRefused

from .settings import ServerSettings

logger = logging.getLogger(__name__)

DEMO = "demo"
TOOL_CALL_OPENING = "<tool_call>\n"  # the demo's chat template's (engine/agent/data/chatml_tools.jinja)
DEMO_CONTEXT_PER_SESSION = 2048  # tokens of the demo server's context for each session it serves at once


@dataclass
class Agents:
    config: LLMConfig
    client: LLMClient
    demo: DemoLLM | None
    model_id: str  # what `/v1/models` and the session object call the agent

    @property
    def forced_call_prefill(self) -> str | None:
        """What the assistant's turn must start with for the LLM to honour a forced tool choice: llama.cpp's server
        (the demo's build) grammar-constrains a call only after its opening tag, and takes `tool_choice` as a
        string alone; None for other servers, which force the call themselves."""
        return TOOL_CALL_OPENING if self.demo is not None else None

    async def aclose(self) -> None:
        await self.client.aclose()

    def stop(self) -> None:
        if self.demo is not None:
            self.demo.stop()


def not_an_stt_model(llm: str, model: str) -> InputRefused:
    return InputRefused(
        f"{llm}: a voice agent hears through a Kyutai STT model, and the main model ({model}) is a conversation "
        "model: serve an STT model (--hf-repo kyutai/stt-1b-en_fr) with --tts and --llm",
        "llm",
    )


def load_agents(settings: ServerSettings, speech_to_text: bool, model_id: str) -> Agents | None:
    """The agents' LLM of `--llm` (None without it); `InputRefused` (option `llm`) for a main model that cannot
    hear for an agent, or a demo server that cannot run here."""
    if settings.llm is None:
        return None
    if not speech_to_text:
        raise not_an_stt_model(settings.llm, model_id)
    demo = None
    base_url = settings.llm
    if settings.llm == DEMO:
        parallel = max(1, min(settings.max_sessions, 8))
        demo = start_demo_llm(DemoLLMConfig(parallel=parallel, context=DEMO_CONTEXT_PER_SESSION * parallel))
        base_url = demo.base_url
    try:
        config = LLMConfig(base_url, settings.llm_model, settings.llm_api_key, max_tokens=settings.llm_max_tokens)
    except InputRefused:
        if demo is not None:
            demo.stop()
        raise
    logger.info("voice agents: the LLM at %s (model %s)", config.base_url, config.model)
    return Agents(config, LLMClient(config), demo, f"{model_id}+agent")
