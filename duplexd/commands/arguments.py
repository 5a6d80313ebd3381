"""Arguments that more than one command takes, defined once so that they read the same wherever they are given."""

from __future__ import annotations

import argparse

from duplexd.engine.models.int8_weights import WEIGHT_DTYPES


def add_weights_dtype(p: argparse.ArgumentParser) -> None:
    """`--weights-dtype` of a command that loads an LM checkpoint (`infer`, `speak`): None keeps it as stored."""
    p.add_argument(
        "--weights-dtype",
        choices=WEIGHT_DTYPES,
        help="LM projections: int8 (quantized as they load) or bf16 (the weights' dtype); default: as stored",
    )
