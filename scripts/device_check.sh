#!/usr/bin/env bash
# The feed's accelerator claims measured on the accelerator (scripts/device_check.py says what):
#     scripts/device_check.sh [--out FILE] [--link-gbs GBS]
# Run it whenever a GPU or TPU machine is available (JAX built for it: jax[cuda12] or jax[tpu]);
# append the table it prints to docs/benchmarks.md. Where JAX sees no accelerator it runs the
# CPU fallback (a few small steps on 2 simulated devices), which tests/test_device_check.py runs.
# Bounded: stopped after 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
backend=$(timeout 120 "$PYTHON" -c 'import jax; print(jax.default_backend())' 2>/dev/null || echo cpu)
if [ "$backend" = cpu ]; then
    echo "device_check: JAX sees no GPU or TPU: the CPU fallback (small, not an accelerator's figures)" >&2
    export JAX_PLATFORMS=cpu
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=2"  # the last wins
    set -- --small "$@"
fi
exec timeout 480 "$PYTHON" scripts/device_check.py "$@"
