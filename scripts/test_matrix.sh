#!/usr/bin/env bash
# The torch-free tests on other Python versions: for each version given (default 3.12 3.13), a
# virtual environment of its own under var/matrix/ with the client and the control plane
# installed (`clients/python` and `.[controlplane]`, no torch; `markdown` for the runbook
# anchors), then the wire schema, test vectors, client, OpenAPI, version and control-plane tests
# in it. The full suite runs on the main .venv.
#
#   scripts/test_matrix.sh              # 3.12 and 3.13
#   scripts/test_matrix.sh 3.13         # one version
#
# An interpreter is taken from pyenv ($PYENV_ROOT/versions/X.Y*), else pythonX.Y on PATH. A
# version with no interpreter is skipped and named at the end; MATRIX_REQUIRED=1 (CI) makes it
# an error instead.
# A virtual environment is rebuilt when pyproject.toml is newer than it.
set -euo pipefail
cd "$(dirname "$0")/.."

VERSIONS=("$@")
[ ${#VERSIONS[@]} -gt 0 ] || VERSIONS=(3.12 3.13)
skipped=()
TESTS=(
  tests/test_wire.py tests/test_wire_segments.py tests/test_vectors.py tests/test_openapi.py
  tests/test_client_aggregate.py tests/test_version.py tests/test_no_history.py
  tests/test_configuration_reference.py tests/test_runbooks.py
  tests/runtime_link/test_aggregation.py tests/runtime_link/test_shipper.py
  tests/runtime_link/test_interval_shipping.py tests/runtime_link/test_segment_aggregation.py
  tests/controlplane/deployments tests/controlplane/stats
  tests/controlplane/drift/test_detectors.py tests/controlplane/calibration/test_learn_then_test.py
  tests/controlplane/guards tests/test_layout_docs.py
  tests/runtime_link/test_async_runtime_surface.py tests/runtime_link/test_client_metrics.py
)

interpreter() {
  local version=$1 candidate
  for candidate in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version"*/bin/python; do
    [ -x "$candidate" ] && { echo "$candidate"; return 0; }
  done
  command -v "python$version" || return 1
}

for version in "${VERSIONS[@]}"; do
  python=$(interpreter "$version") || {
    if [ "${MATRIX_REQUIRED:-0}" = 1 ]; then
      echo "test_matrix: no Python $version (pyenv install $version, or put python$version on PATH)" >&2
      exit 2
    fi
    skipped+=("$version")
    continue
  }
  venv=var/matrix/py$version
  started=$(date +%s)
  if [ ! -f "$venv/.installed" ] || [ pyproject.toml -nt "$venv/.installed" ] \
      || [ clients/python/pyproject.toml -nt "$venv/.installed" ] \
      || [ "$0" -nt "$venv/.installed" ]; then
    "$python" -m venv --clear "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -e clients/python
    "$venv/bin/python" -m pip install -q -e '.[controlplane]' --config-settings editable_mode=compat \
      'pytest>=8.3' 'pytest-timeout>=2.3' 'hypothesis>=6.100' 'markdown>=3.5'
    touch "$venv/.installed"
  fi
  if "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    echo "test_matrix: torch is installed in $venv; these tests must run without it" >&2
    exit 1
  fi
  echo "== Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')"
  "$venv/bin/python" -m pytest -m "not slow" -p no:cacheprovider -q "${TESTS[@]}" \
    ${MATRIX_PYTEST_ARGS:-}
  echo "== Python $version: $(( $(date +%s) - started )) s"
done
if [ ${#skipped[@]} -gt 0 ]; then
  echo "test_matrix: SKIPPED Python ${skipped[*]}: no interpreter (pyenv install X.Y, or put" \
    "pythonX.Y on PATH; MATRIX_REQUIRED=1 makes this an error)" >&2
fi
