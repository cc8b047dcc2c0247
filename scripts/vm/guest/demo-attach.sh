#!/usr/bin/env bash
# Guest side of scripts/demo: the Linux 6.12 NVMe/TCP host driver attaches the
# nvpool-target that runs on the HOST (reached through run-guest-test --guestfwd) and
# uses it the way a training job uses a dataset volume: ext4, a few thousand small files
# of random data, then one epoch reading every file back in shuffled order.
#
#   scripts/vm/run-guest-test scripts/vm/guest/demo-attach.sh \
#       --guestfwd 4420:4420 --guestfwd 8009:8009 \
#       --env DEMO_HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:... [--env DEMO_FILES=2000]
#
# Output is a few lines per phase for humans, then one "DEMO-RESULT key=value ..." line
# that scripts/demo reads back from the console log.
#
# vm-modules: nvme-tcp ext4
# vm-bins: nvme mkfs.ext4 e2fsck fio
# shellcheck source-path=SCRIPTDIR source=lib/common.sh
. /nvpool/lib/common.sh
# shellcheck source=lib/nvme-tcp.sh
. /nvpool/lib/nvme-tcp.sh

[[ -n ${NVPOOL_VM_FWD_ADDR:-} && -n ${NVPOOL_VM_NET_CIDR:-} ]] ||
    die "no guest network: run with --guestfwd 4420:4420 --guestfwd 8009:8009"

# Used by the nvme-tcp.sh helpers (connect, disconnect, nvme_ns_dev).
NVME_ADDR=$NVPOOL_VM_FWD_ADDR
NVME_IO_PORT=${DEMO_IO_PORT:-4420}
NVME_DISC_PORT=${DEMO_DISC_PORT:-8009}
NVME_NQN=${DEMO_NQN:-nqn.2026-11.io.nvpool:demo}
NVME_NSID=1
NVME_HOSTNQN=${DEMO_HOSTNQN:-nqn.2014-08.org.nvmexpress:uuid:6e76706f-6f6c-4d00-8000-64656d6f0001}

# The dataset: DEMO_FILES files of 64..256 KiB spread over DEMO_DIRS directories.
DEMO_FILES=${DEMO_FILES:-2000}
DEMO_DIRS=${DEMO_DIRS:-8}
FILE_MIN_KIB=64
FILE_MAX_KIB=256
# Parallel readers in the read epoch, like a data loader's workers, and files per cat.
DEMO_READERS=${DEMO_READERS:-8}
READ_BATCH=10
NIC_APPEAR_S=10
STAGE=/tmp/dataset
MNT=/mnt/demo
SUMS=/tmp/dataset.sha256

for v in DEMO_FILES DEMO_DIRS DEMO_READERS; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: expected a positive integer"
done

say() {
    printf '%s\n' "$*"
}

# Seconds since boot with centiseconds, for timing phases.
now() {
    cut -d' ' -f1 /proc/uptime
}

# since T0: seconds elapsed since T0 (from now), two decimals.
since() {
    awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'
}

# rates COUNT BYTES SECONDS: "N files/s, M MB/s" (MB = 10^6 bytes).
rates() {
    awk -v n="$1" -v b="$2" -v s="$3" 'BEGIN {
        if (s <= 0) s = 0.01
        printf "%.0f files/s, %.1f MB/s", n / s, b / s / 1e6 }'
}

first_nic() {
    local n
    for n in /sys/class/net/*; do
        [[ ${n##*/} == lo ]] && continue
        printf '%s\n' "${n##*/}"
        return 0
    done
    return 1
}

have_nic() {
    first_nic >/dev/null
}

net_up() {
    local nic
    wait_until "$NIC_APPEAR_S" "the virtio network card" have_nic
    nic=$(first_nic)
    ip addr add "$NVPOOL_VM_NET_CIDR" dev "$nic"
    ip link set "$nic" up
    say "network: $nic $NVPOOL_VM_NET_CIDR; the host's target is forwarded to $NVME_ADDR" \
        "(QEMU user networking, restrict=on: nothing else leaves the guest)"
}

# One line per discovery log entry.  TRADDR is the address the target listens on as
# the host sees it (127.0.0.1): the guest reaches it only through the forward.
discover() {
    host_opts "$NVME_HOSTNQN"
    quiet discover nvme discover -t tcp -a "$NVME_ADDR" -s "$NVME_DISC_PORT" \
        "${HOST_OPTS[@]}"
    grep -Eq "^subnqn: +$NVME_NQN\$" /tmp/out.discover || {
        cat /tmp/out.discover
        die "the discovery log does not list $NVME_NQN"
    }
    say "nvme discover -t tcp -a $NVME_ADDR -s $NVME_DISC_PORT:" \
        "$(grep -c '^=====Discovery Log Entry' /tmp/out.discover) entries" \
        "(TRADDR is the target's own, host-side address)"
    awk '
        function show() {
            if (nqn != "") printf "  %-28s %s at %s:%s\n", type, nqn, addr, port
            nqn = ""
        }
        /^=====Discovery Log Entry/ { show() }
        /^subtype:/ { sub(/^subtype: +/, ""); type = $0 }
        /^trsvcid:/ { port = $2 }
        /^traddr:/  { addr = $2 }
        /^subnqn:/  { nqn = $2 }
        END { show() }
    ' /tmp/out.discover
}

attach() {
    local c=/sys/class/nvme/$CTRL bytes
    bytes=$(($(cat "/sys/block/${DEV#/dev/}/size") * 512))
    say "nvme connect -t tcp -a $NVME_ADDR -s $NVME_IO_PORT -n $NVME_NQN:" \
        "$DEV, $(awk -v b="$bytes" 'BEGIN { printf "%.1f GiB", b / 1073741824 }')"
    say "  controller $CTRL: cntlid $(cat "$c/cntlid"), $(cat "$c/state")," \
        "$(($(cat "$c/queue_count") - 1)) I/O queues, model '$(xargs <"$c/model")'," \
        "$(cat "$c/address")"
    NS_BYTES=$bytes
    IO_QUEUES=$(($(cat "$c/queue_count") - 1))
}

make_fs() {
    local t0
    t0=$(now)
    # Initialise inode tables and journal now, so no background zeroing overlaps the
    # timed phases.
    quiet mkfs mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$DEV"
    mkdir -p "$MNT"
    mount -t ext4 "$DEV" "$MNT"
    say "mkfs.ext4 + mount $MNT: $(since "$t0")s"
}

# Random data staged in RAM first, so the timed write measures the filesystem and the
# NVMe/TCP path, not data generation.  One fio process writes every file (a shell loop
# spawning a program per file takes minutes under TCG); refill_buffers makes every
# block fresh random data.  Sizes are random in the range, in 4 KiB steps.
make_dataset() {
    local t0 i dir gen_s files job=/tmp/dataset.fio
    t0=$(now)
    {
        printf '[global]\nioengine=psync\nrw=write\nbs=4k\nrefill_buffers=1\n'
        printf 'filesize=%dk-%dk\nnrfiles=%d\n' "$FILE_MIN_KIB" "$FILE_MAX_KIB" \
            $((DEMO_FILES / DEMO_DIRS))
        printf 'openfiles=1\nfile_service_type=sequential\ncreate_on_open=1\n'
        # shellcheck disable=SC2016 # fio expands $filenum
        printf 'filename_format=sample$filenum.bin\n'
        for ((i = 0; i < DEMO_DIRS; i++)); do
            dir=$STAGE/$(printf 'shard%02d' "$i")
            mkdir -p "$dir"
            # The first shards take the remainder of DEMO_FILES / DEMO_DIRS.
            printf '[%s]\ndirectory=%s\n' "${dir##*/}" "$dir"
            if ((i < DEMO_FILES % DEMO_DIRS)); then
                printf 'nrfiles=%d\n' $((DEMO_FILES / DEMO_DIRS + 1))
            fi
        done
    } >"$job"
    quiet dataset fio "$job"
    gen_s=$(since "$t0")
    t0=$(now)
    (cd "$STAGE" && find . -type f | sort | xargs sha256sum) >"$SUMS"
    files=$(wc -l <"$SUMS")
    [[ $files -eq $DEMO_FILES ]] || die "fio made $files files, expected $DEMO_FILES"
    DATA_BYTES=$(find "$STAGE" -type f -exec stat -c %s {} + | awk '{ n += $1 } END { print n }')
    say "dataset: $DEMO_FILES files of $FILE_MIN_KIB-$FILE_MAX_KIB KiB random data" \
        "($((DATA_BYTES / 1048576)) MiB) in $DEMO_DIRS dirs, made in RAM in ${gen_s}s," \
        "sha256 of each in $(since "$t0")s"
}

write_dataset() {
    local t0
    t0=$(now)
    cp -a "$STAGE/." "$MNT/"
    sync
    WRITE_S=$(since "$t0")
    rm -rf "$STAGE"
    say "write: cp to ext4 + sync: ${WRITE_S}s, $(rates "$DEMO_FILES" "$DATA_BYTES" "$WRITE_S")"
}

# One epoch: cold cache, every file read whole, in a random order.
read_epoch() {
    local t0 shuffled=/tmp/dataset.shuffled
    sync
    echo 3 >/proc/sys/vm/drop_caches
    shuf "$SUMS" >"$shuffled"
    t0=$(now)
    (cd "$MNT" && awk '{ print $2 }' "$shuffled" |
        xargs -P "$DEMO_READERS" -n "$READ_BATCH" cat) >/dev/null
    READ_S=$(since "$t0")
    say "read epoch: caches dropped, every file once in shuffled order by $DEMO_READERS" \
        "readers: ${READ_S}s, $(rates "$DEMO_FILES" "$DATA_BYTES" "$READ_S")"
    # The page cache now holds exactly what the reads returned from the device.
    quiet verify sh -c "cd '$MNT' && sha256sum -c '$shuffled'"
    VERIFIED=$(grep -c ': OK$' /tmp/out.verify || true)
    [[ $VERIFIED -eq $DEMO_FILES ]] ||
        die "only $VERIFIED of $DEMO_FILES files verified"
    say "verify: $VERIFIED/$DEMO_FILES sha256 match (in the same shuffled order)"
}

check_fs() {
    umount "$MNT"
    quiet e2fsck e2fsck -fn "$DEV"
    say "umount + e2fsck -fn: clean" \
        "($(grep -Eo '[0-9]+/[0-9]+ files' /tmp/out.e2fsck || echo 'no summary'))"
}

say "guest: Linux $(uname -r), NVMe/TCP host driver nvme-tcp; host NQN $NVME_HOSTNQN"
net_up
discover
connect demo
attach
make_fs
make_dataset
write_dataset
read_epoch
check_fs
disconnect
say "nvme disconnect -n $NVME_NQN: done"
printf 'DEMO-RESULT kernel=%s dev=%s ns_bytes=%s io_queues=%s files=%s bytes=%s' \
    "$(uname -r)" "$DEV" "$NS_BYTES" "$IO_QUEUES" "$DEMO_FILES" "$DATA_BYTES"
printf ' write_s=%s read_s=%s readers=%s verified=%s fsck=clean\n' "$WRITE_S" "$READ_S" \
    "$DEMO_READERS" "$VERIFIED"
