#!/usr/bin/env bash
# Lint and format check; pass --fix to rewrite files in place.
set -euo pipefail
cd "$(dirname "$0")"
if [[ "${1:-}" == "--fix" ]]; then
    ruff check --fix .
    ruff format .
else
    ruff check .
    ruff format --check .
fi
