#!/usr/bin/env bash
# End to end on this host, as root: rolling a thin RAID1 volume back to a
# snapshot with real processes (a control plane and two targets on grain
# pools, the agent serving the volume through FUSE + loop).
#
# Records are written, a snapshot taken, the records overwritten. A
# rollback while the volume is attached is refused (volume_attached); once
# detached it succeeds, and attached again the volume reads the records of
# the snapshot, on both copies (verify). The snapshot stays, a newer one
# too, and the same rollback again changes nothing.
#
# Usage: tests/e2e/rollback.sh [BIN_DIR]   (default target/release)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN=$(cd "${1:-target/release}" && pwd)
source tests/e2e/lib.sh

need_host jq curl

trap cleanup EXIT
BLOCKS=256

quiet() { "$@" >/dev/null; }

# fill DEV WORD: block i holds `WORD i` (padded to 4 KiB), i < BLOCKS.
fill() {
    local dev=$1 word=$2 i
    for ((i = 0; i < BLOCKS; i++)); do
        printf '%s %d' "$word" "$i" |
            dd of="$dev" bs=4096 seek="$i" count=1 conv=sync,notrunc oflag=direct \
                status=none || return 1
    done
    sync
}

# holds DEV WORD: every block i < BLOCKS holds `WORD i`.
holds() {
    dd if="$1" bs=4096 count="$BLOCKS" iflag=direct status=none | tr '\0' '\n' | grep -a . |
        awk -v w="$2" -v n="$BLOCKS" '$1 != w || $2 + 0 != NR - 1 { bad = 1; exit }
            END { exit (bad || NR != n) }'
}

attach() { nvpool volume attach data --frontend fuse --host-nqn "$HOSTNQN"; }
detach() { quiet nvpool volume detach data --host-nqn "$HOSTNQN"; }

log "starting a control plane and 2 targets on grain pools in $E2E_DIR"
start_control_plane || { bad "control plane starts"; summary; exit 1; }
for i in 0 1; do start_thin_target "$i"; done
check "2 targets register and are online" wait_targets 2
check "a 256 MiB thin RAID1 volume" quiet \
    nvpool volume create data --size 256M --layout raid1 --copies 2

dev=$(attach)
check "attach gives a block device (got '$dev')" test -b "$dev"
check "write the old records" fill "$dev" old
check "snapshot data@s1" quiet nvpool snapshot create data@s1
check "overwrite them" fill "$dev" new
check "snapshot data@s2 of the new ones" quiet nvpool snapshot create data@s2
check "the volume holds the new records" holds "$dev" new

out=$("$BIN/nvpool" snapshot rollback data@s1 2>&1)
rc=$?
log "rollback while attached: exit $rc: $out"
check "a rollback while attached is refused (exit 1), naming the host" \
    bash -c "[[ $rc -eq 1 ]] && grep -q '$HOSTNQN' <<<'$out'"
check "and changed nothing" holds "$dev" new

check "detach" detach
check "rollback to data@s1" quiet nvpool snapshot rollback data@s1
check "the same rollback again" quiet nvpool snapshot rollback data@s1
check "-o json prints the volume" \
    test "$(nvpool snapshot rollback data@s1 -o json | jq -r .name)" = data
dev=$(attach)
check "attach again (got '$dev')" test -b "$dev"
check "the volume holds the old records" holds "$dev" old
check "both copies agree" quiet nvpool volume verify data
check "both snapshots stay" \
    test "$(nvpool snapshot ls data -o json | jq length)" -eq 2
check "detach" detach

check "rollback to the newer data@s2" quiet nvpool snapshot rollback data@s2
dev=$(attach)
check "the volume holds the new records again" holds "$dev" new
check "detach" detach

check "a bad name is a usage error (exit 2)" \
    bash -c "'$BIN/nvpool' snapshot rollback data 2>/dev/null; [[ \$? -eq 2 ]]"
check "a snapshot that does not exist is refused" \
    bash -c "! '$BIN/nvpool' snapshot rollback data@none 2>/dev/null"

for s in s1 s2; do check "delete data@$s" quiet nvpool snapshot rm "data@$s"; done
check "delete data" quiet nvpool volume delete data

summary
