"""The `duplexd` command line.

A command's module is imported only when that command is given: `duplexd chat` and `loadtest` are client
processes, often many at once, and the model commands' torch would cost each 2.5 s of CPU and ~300 MB for nothing.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import typing

from duplexd.clients.audio import InputError
from duplexd.engine.errors import InputRefused
from duplexd.engine.models.config import ConfigError
from duplexd.server.core.settings import SettingsError

# name: (its module, with `add_arguments(parser)` and `run(args) -> exit status`; one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("duplexd.commands.generate", "run the LM on random user codes and print its text"),
    "infer": ("duplexd.commands.infer", "run a whole audio file through the model, streaming frame by frame"),
    "capacity": (
        "duplexd.commands.capacity",
        "how many sessions fit on a GPU (the server's own sizing, no memory used)",
    ),
    "transcribe": (
        "duplexd.commands.transcribe",
        "transcribe an audio file with Gemma 4 (split at pauses, any length) or Kyutai STT (words)",
    ),
    "speak": ("duplexd.commands.speak", "text to speech with a Kyutai TTS model (a wav file out)"),
    "voice": ("duplexd.commands.voice", "voice cloning: `voice make AUDIO --out VOICE.safetensors`, a voice for speak"),
    "serve": ("duplexd.server.cli", "serve the model over WebSockets (Kyutai protocol and OpenAI Realtime)"),
    "chat": (
        "duplexd.clients.chat",
        "talk to a server with an audio file; save the model's speech and print its text",
    ),
    "loadtest": ("duplexd.clients.loadtest_cli", "N concurrent real-time sessions against a server; latency report"),
}


class Parser(argparse.ArgumentParser):
    """Usage errors as one line (`duplexd serve: error: ...`), exit 2, as every start-up error is."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def error_line(command: str, error: Exception) -> str:
    """One line naming the option at fault: an engine error's `option` keyword becomes its flag."""
    option = getattr(error, "option", None)
    text = f"--{option.replace('_', '-')} {error}" if option else str(error)
    return f"duplexd {command}: error: {' '.join(text.split())}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line, with `command`'s arguments (its module imported); every other command by its name and help
    alone, taking any arguments, so that a first parse finds which command was given."""
    parser = Parser(prog="duplexd", description="Full-duplex speech-dialogue server.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (path, text) in COMMANDS.items():
        if name != command:
            sub.add_parser(name, help=text, add_help=False)
            continue
        module = importlib.import_module(path)
        p = sub.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    given, _ = build_parser().parse_known_args(argv)
    args = build_parser(given.command).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return args.func(args)
    except (InputRefused, ConfigError, SettingsError, InputError) as e:
        print(error_line(args.command, e), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
