#!/usr/bin/env bash
# The REST API against its own OpenAPI document: schemathesis generates
# requests from docs/openapi.json (examples, coverage, fuzzing and stateful
# sequences that create, attach, detach and delete; every check, as configured
# in tests/e2e/schemathesis.toml) against a control plane
# with two real targets, and checks every answer against the document (status,
# content type, schema, headers), that no answer is a 5xx other than the
# documented 503s, and that what one call creates the next can find.
#
# Usage: tests/e2e/api-fuzz.sh BIN_DIR  (BIN_DIR: the release binaries)
# Env:   NVPOOL_FUZZ_EXAMPLES (per operation, default 25)
set -euo pipefail
BIN=$(cd "$1" && pwd)
cd "$(dirname "$0")/../.."
CP_PORT=${CP_PORT:-14530} TARGET_PORT_BASE=${TARGET_PORT_BASE:-14520} \
    ADMIN_PORT_BASE=${ADMIN_PORT_BASE:-14580}
source tests/e2e/lib.sh
trap cleanup EXIT

VENV=${NVPOOL_FUZZ_VENV:-/var/tmp/nvpool-schemathesis}
SCHEMATHESIS_VERSION=4.32.5
if ! "$VENV/bin/schemathesis" --version 2>/dev/null | grep -q "$SCHEMATHESIS_VERSION"; then
    log "installing schemathesis $SCHEMATHESIS_VERSION into $VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q "schemathesis==$SCHEMATHESIS_VERSION"
fi

(umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$E2E_DIR/admin-token")
(umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$E2E_DIR/target-token")
export NVPOOL_TOKEN_FILE=$E2E_DIR/admin-token
CP_ARGS=(--admin-token-file "$E2E_DIR/admin-token" --target-token-file "$E2E_DIR/target-token")
TARGET_ARGS=(--control-plane-token-file "$E2E_DIR/target-token")
EXTENT_BYTES=$((1 << 30)) start_control_plane
start_target 0 8G
start_target 1 8G
wait_targets 2
nvpool pool create fuzz --device t0/d0 --device t1/d0 >/dev/null

log "schemathesis: ${NVPOOL_FUZZ_EXAMPLES:-25} examples per operation, every check, stateful"
st_rc=0
# The admin token: the fuzzer explores what the API does, not who may call
# it (the route table's test covers every role). Heartbeats and leases with
# made-up target ids only get 404s; registrations it makes up may point at
# addresses nobody listens on, whose reconciles then fail harmlessly.
"$VENV/bin/schemathesis" --config-file tests/e2e/schemathesis.toml run docs/openapi.json \
    --url "$NVPOOL_ENDPOINT" \
    --header "Authorization: Bearer $(cat "$E2E_DIR/admin-token")" \
    --phases examples,coverage,fuzzing,stateful \
    --max-examples "${NVPOOL_FUZZ_EXAMPLES:-25}" \
    --request-timeout 30 \
    --workers 1 \
    --seed 1 \
    --no-color \
    >"$E2E_DIR/schemathesis.log" 2>&1 || st_rc=$?
tail -n 40 "$E2E_DIR/schemathesis.log"
if ((st_rc == 0)); then ok "schemathesis: every answer matches the document"; else
    bad "schemathesis (exit $st_rc; the whole report: $E2E_DIR/schemathesis.log)"
fi
check "the control plane is still up" curl -sf "$NVPOOL_ENDPOINT/healthz" -o /dev/null
# The fuzzer holds the admin's token, so it may take the two targets out of the
# cluster (a delete) and register made-up ones at their freed addresses: what
# must hold is that both daemons survived what it sent through them.
targets_alive() {
    local i
    for i in 0 1; do
        kill -0 "${TARGET_PIDS[i]}" 2>/dev/null || return 1
        target_admin "$i" /v1/target -o /dev/null || return 1
    done
}
check "both target daemons are still running and answer their admin API" targets_alive

echo "api-fuzz: $pass passed, $fail failed"
((fail == 0))
