#!/usr/bin/env bash
# Run the test suite in the project's .venv (created on first use); the per-test timeout is in
# setup.cfg. Extra arguments go to pytest, e.g. scripts/test.sh tests/test_sampler.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/venv.sh
exec python -m pytest -q -p no:cacheprovider "$@"
