#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=25 "$@"  # the slowest tests named: where CI time goes
