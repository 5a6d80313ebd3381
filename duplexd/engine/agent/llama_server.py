"""The demo LLM's process: llama.cpp's own HTTP server (the `xllamacpp` wheel) on loopback, until told to stop.

`demo_llm.py` starts it as a child (`python -m duplexd.engine.agent.llama_server ...`) so that llama.cpp's
threads, memory and logs stay out of duplexd's process and a stop is certain. It prints `READY <url>` once the
model is loaded and the port listens, then waits for SIGTERM or SIGINT, or for its stdin to close: the parent
keeps that pipe open, so a parent killed outright takes its server with it.
"""

from __future__ import annotations

import argparse
import importlib.resources
import signal
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m duplexd.engine.agent.llama_server")
    parser.add_argument("--model", required=True, help="the GGUF file")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=2048, help="the context, in tokens")
    parser.add_argument("--parallel", type=int, default=1, help="requests served at once (the context is split)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--chat-template-file", help="default: duplexd's ChatML template with tools")
    args = parser.parse_args(argv)

    import xllamacpp

    if args.chat_template_file:
        with open(args.chat_template_file, encoding="utf-8") as f:
            template = f.read()
    else:
        template = importlib.resources.files(__package__).joinpath("data/chatml_tools.jinja").read_text("utf-8")
    params = xllamacpp.CommonParams()
    params.model.path = args.model
    params.hostnames = ["127.0.0.1"]
    params.port = args.port
    params.n_ctx = args.ctx
    params.n_parallel = args.parallel
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.sampling.seed = args.seed
    params.use_jinja = True
    params.chat_template = template
    try:
        server = xllamacpp.Server(params)  # loads the model and listens before it returns
    except RuntimeError as exc:  # llama.cpp has logged why, just above
        print(f"llama.cpp's server did not start: {exc}", file=sys.stderr, flush=True)
        return 1

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    def stop_at_eof() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=stop_at_eof, daemon=True).start()
    print("READY", server.listening_address, flush=True)
    stop.wait()
    del server
    return 0


if __name__ == "__main__":
    sys.exit(main())
