"""The plain-Python statement of PersonaPlex's rules (tests/personaplex_ref.py) against the facts known of the
reference: call counts, which frames the model reads, the first live output, the preset's replay."""

from __future__ import annotations

import pytest
import torch

from duplexd.engine.persona.prompt import SILENCE_CODES, SINE_CODES, TEXT_PAD, prompt_calls, wrap_role_text

from .personaplex_files import PP_SMALL
from .personaplex_ref import Oracle, ReferenceSession, preset_from_codes
from .ref_models import reference_lm

CFG = PP_SMALL
INIT_TEXT, INIT_AUDIO = CFG.text_initial_token_id, CFG.initial_token_id
V, PROMPT = 5, [21, 42, 99, 7]
P = prompt_calls(V, len(PROMPT))
# Distinct codes per voice frame f and codebook k, so every read is traceable to its frame.
VOICE = [[100 * f + 10 + k for k in range(8)] for f in range(V)]
USER = [[1500 + 10 * u + k for k in range(8)] for u in range(6)]


def _session(**prompt) -> ReferenceSession:
    s = ReferenceSession(CFG)
    s.prompt(PROMPT, **prompt)
    return s


def _col(text, agent0, agent_rest, user0, user_rest):
    return [text, agent0, *agent_rest, user0, *user_rest]


def test_call_counts_and_the_first_call():
    s = _session(codes=VOICE)
    assert P == V + 12 + len(PROMPT) == len(s.calls)
    assert s.calls[0].input is None and all(c.input is not None for c in s.calls[1:])
    assert sum(c.input is not None for c in s.calls) == P - 1


def test_rows_the_model_reads_during_the_prompt():
    rows = [c.input for c in _session(codes=VOICE).calls[1:]]  # rows[j]: column j, the j-th forward's input
    assert rows[0] == [INIT_TEXT] + [INIT_AUDIO] * 16  # voice frame 0 is dropped
    assert rows[1] == _col(TEXT_PAD, VOICE[1][0], [INIT_AUDIO] * 7, SINE_CODES[0], [INIT_AUDIO] * 7)
    assert rows[2] == _col(TEXT_PAD, VOICE[2][0], VOICE[1][1:], SINE_CODES[0], SINE_CODES[1:])
    assert not any(VOICE[0][k] in row for row in rows for k in range(8))
    assert rows[V - 1] == _col(TEXT_PAD, VOICE[V - 1][0], VOICE[V - 2][1:], SINE_CODES[0], SINE_CODES[1:])
    assert rows[V] == _col(TEXT_PAD, SILENCE_CODES[0], VOICE[V - 1][1:], SINE_CODES[0], SINE_CODES[1:])
    silent = _col(TEXT_PAD, SILENCE_CODES[0], SILENCE_CODES[1:], SINE_CODES[0], SINE_CODES[1:])
    assert rows[V + 1 : V + 6] == [silent] * 5
    for i, token in enumerate(PROMPT):  # one prompt token per column, the audio silent
        assert rows[V + 6 + i] == [token, *silent[1:]]
    assert rows[V + 6 + len(PROMPT) : P - 1] == [silent] * 5
    assert len(rows) == P - 1


def test_first_live_frames():
    s = _session(codes=VOICE)
    live = [s.live(u) for u in USER]
    silent = _col(TEXT_PAD, SILENCE_CODES[0], SILENCE_CODES[1:], SINE_CODES[0], SINE_CODES[1:])
    assert live[0].input == silent  # the last all-silence row
    assert live[0].output == [TEXT_PAD, *SILENCE_CODES, *SINE_CODES]  # PAD + SILENCE first, whatever was sampled
    # The user's frame u is read one call later: its cb0 by live call u + 1, its cb1-7 by live call u + 2.
    assert live[1].input[9:] == [USER[0][0], *SINE_CODES[1:]]
    for u in range(2, len(USER)):
        assert live[u].input[9:] == [USER[u - 1][0], *USER[u - 2][1:]]
    # Live call 0's agent cb1-7 target stays forced to SILENCE; from call 1 on the model's own values come out.
    assert live[1].output[2:9] == [-7] * 7 and live[1].output[1] == -7 and live[1].output[0] == -7
    assert all(c.output is not None for c in live)


def test_preset_replay_leaves_the_same_rows(tmp_path):
    """A preset made from the voice replays its rows, then its ring: the calls after the voice read exactly what
    the codes' run reads, and the stored rows are the embeddings of the columns the codes' run fed."""
    lm = reference_lm(CFG, seed=3)
    preset = preset_from_codes(CFG, lm, VOICE)
    assert preset["embeddings"].shape == (V - 1, 1, 1, CFG.dim) and preset["cache"].shape == (1, 17, 4)
    cache = preset["cache"][0].tolist()
    by_codes, by_preset = _session(codes=VOICE), _session(preset=(None, V, cache))
    assert len(by_codes.calls) == len(by_preset.calls) == P
    assert [c.input for c in by_preset.calls[1:V]] == list(range(V - 1))
    assert [c.input for c in by_preset.calls[V:]] == [c.input for c in by_codes.calls[V:]]
    oracle = Oracle(lm)
    rows = [c.input for c in by_codes.calls[1:V]]
    assert all(torch.equal(oracle.embed(r), preset["embeddings"][j].view(1, 1, -1)) for j, r in enumerate(rows))
    oracle.close()


def test_role_text_wrapping():
    assert wrap_role_text("  You are kind. ") == "<system> You are kind. <system>"
    assert wrap_role_text("<system> Already. <system>") == "<system> Already. <system>"
    assert wrap_role_text("<system> half") == "<system> <system> half <system>"


@pytest.mark.parametrize("voice_frames", [1, 2, 3])
def test_short_voices(voice_frames):
    s = ReferenceSession(CFG)
    s.prompt(PROMPT, codes=VOICE[:voice_frames])
    assert len(s.calls) == prompt_calls(voice_frames, len(PROMPT))
    assert s.live(USER[0]).output == [TEXT_PAD, *SILENCE_CODES, *SINE_CODES]
