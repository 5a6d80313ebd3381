"""The persona prompt in duplexd's LMGen against the plain-Python statement of the reference's rules, on a
random-weight PersonaPlex checkpoint (perturbed), greedy: the rows the model reads during and after the prompt,
and the first live frames' tokens and logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from duplexd.engine.dialogue.lm_gen import LMGen
from duplexd.engine.dialogue.sampling import SamplingParams
from duplexd.engine.persona.prompt import SILENCE_CODES, TEXT_PAD, Voice, build_prompt
from duplexd.engine.persona.voices import load_preset
from duplexd.engine.weights.checkpoint import load_lm

from .personaplex_files import PP_SMALL, write_personaplex
from .personaplex_ref import Oracle, ReferenceSession, preset_from_codes

CFG = PP_SMALL
GREEDY = SamplingParams(text_temperature=0.0, text_topk=1, audio_temperature=0.0, audio_topk=1)
V, TEXT = 7, [21, 42, 99, 7, 250, 13]
LIVE = 8
TOL = 1e-4


def _codes(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.card, (n, 8), generator=gen).tolist()


VOICE, USER = _codes(V, 1), _codes(LIVE, 2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    path, ref = write_personaplex(root, CFG, seed=4)
    return ref, load_lm(path)


class Recorder:
    """duplexd's LM with every forward's input recorded: the token column embedded (None for a stored row) and
    the summed embedding."""

    def __init__(self, model) -> None:
        self.rows: list[list[int] | None] = []
        self.inputs: list[torch.Tensor] = []
        self._embed, self._forward = model.embed, model.temporal
        self._last: list[int] | None = None
        model.embed, model.temporal = self.embed, self.forward

    def embed(self, tokens):
        self._last = tokens[0].tolist()
        return self._embed(tokens)

    def forward(self, x, *args):
        self.rows.append(self._last)
        self.inputs.append(x[0].clone())
        self._last = None
        return self._forward(x, *args)


def _reference(ref, text, voice_codes=None, preset=None) -> ReferenceSession:
    oracle = Oracle(ref)
    try:
        session = ReferenceSession(CFG, oracle)
        session.prompt(text, codes=voice_codes, preset=preset)
        for u in USER:
            session.live(u)
    finally:
        oracle.close()
    return session


def _duplexd(model, voice: Voice, text, user=USER):
    gen = LMGen(model, num_slots=2)
    gen.reset(1, GREEDY)
    recorder = Recorder(model)
    try:
        gen.prompt(1, build_prompt(CFG, voice, text))
        outs = []
        for u in user:
            outs.append(gen.step(torch.tensor([1]), torch.tensor([u]), return_logits=True))
    finally:
        model.embed, model.temporal = recorder._embed, recorder._forward
    return recorder, outs


def _voice_from_codes(codes) -> Voice:
    return Voice("v", None, len(codes), codes=torch.tensor(codes))  # type: ignore[arg-type]


def _check(ref_session: ReferenceSession, recorder: Recorder, outs, preset_rows: int = 0) -> None:
    forwards = [c for c in ref_session.calls if c.input is not None]
    assert len(recorder.rows) == len(forwards)  # P - 1 prompt forwards, then one per live frame
    for j, (call, row) in enumerate(zip(forwards, recorder.rows, strict=True)):
        if isinstance(call.input, int):  # a stored row, fed as it is
            assert row is None and j < preset_rows
        else:
            assert row == call.input, f"row {j}"
    live = ref_session.calls[-LIVE:]
    assert live[0].output[:9] == [TEXT_PAD, *SILENCE_CODES]
    for u, (call, out) in enumerate(zip(live, outs, strict=True)):
        assert bool(out.valid[0]), f"live frame {u}"
        assert out.tokens[0].tolist() == call.output[:9], f"live frame {u}"
        assert (out.text_logits[0] - call.text_logits).abs().max() <= TOL, f"text logits, live frame {u}"
    texts = {c.output[0] for c in live[1:]} | {c.output[1] for c in live[1:]}
    assert len(texts) > 3, "degenerate run: the model should emit varied tokens"


def test_audio_voice_prompt_matches_the_reference_rules(models):
    ref, model = models
    session = _reference(ref, TEXT, voice_codes=VOICE)
    recorder, outs = _duplexd(model, _voice_from_codes(VOICE), TEXT)
    _check(session, recorder, outs)


def test_preset_voice_prompt_matches_the_reference_rules(models, tmp_path):
    ref, model = models
    state = preset_from_codes(CFG, ref, VOICE)
    torch.save(state, tmp_path / "v.pt")
    voice = load_preset(tmp_path / "v.pt", CFG)
    session = _reference(ref, TEXT, preset=(state["embeddings"][:, 0], V, state["cache"][0].tolist()))
    recorder, outs = _duplexd(model, voice, TEXT)
    _check(session, recorder, outs, preset_rows=V - 1)
    for j in range(V - 1):  # the stored rows reach the model as stored
        assert torch.equal(recorder.inputs[j], state["embeddings"][j, 0, 0])
    # A preset made from the same codes leaves the same conversation as the codes themselves.
    _, by_codes = _duplexd(model, _voice_from_codes(VOICE), TEXT)
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(outs, by_codes, strict=True))


@pytest.mark.parametrize("change", ["text", "voice"])
def test_one_prompt_word_or_voice_frame_changes_what_follows(models, change):
    _, model = models
    text, voice = list(TEXT), [list(f) for f in VOICE]
    if change == "text":
        text[3] = 8
    else:
        voice[3][0] = (voice[3][0] + 1) % CFG.card
    base_rows, base = _duplexd(model, _voice_from_codes(VOICE), TEXT)
    rows, outs = _duplexd(model, _voice_from_codes(voice), text)
    prompt = len(base_rows.rows) - LIVE  # P - 1 prompt rows: exactly one differs
    assert sum(a != b for a, b in zip(base_rows.rows[:prompt], rows.rows[:prompt], strict=True)) == 1
    assert all(not torch.equal(a.text_logits, b.text_logits) for a, b in zip(base, outs, strict=True))


def test_prompt_refused_on_a_moshi_model():
    from duplexd.engine.weights.demo import random_lm

    moshi_cfg = dataclasses.replace(CFG, dep_q=8)
    moshi = random_lm(moshi_cfg, seed=0)
    with pytest.raises(ValueError, match="needs a PersonaPlex model"):
        build_prompt(moshi_cfg, _voice_from_codes(VOICE), TEXT)
    gen = LMGen(moshi, num_slots=1)
    with pytest.raises(ValueError, match="needs a PersonaPlex model"):
        gen.prompt(0, build_prompt(CFG, _voice_from_codes(VOICE), TEXT))
