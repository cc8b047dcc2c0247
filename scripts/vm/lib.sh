# shellcheck shell=bash
# shellcheck disable=SC2034 # some settings are read by run-guest-test
# Host-side helpers for running one test script inside a throwaway QEMU guest that
# boots Debian's 6.12 kernel.  Sourced by run-guest-test; everything here is prefixed vm_.
#
#   vm_fetch_kernel     apt-get download + dpkg -x into $VM_CACHE/kernels/<package>/ (once)
#   vm_build_initramfs  busybox + kmod + host tools with their libraries + the modules the
#                       test needs (with dependencies) + extra files + the guest script
#   vm_boot             qemu, guest console streamed to stdout and appended to a log
#
# The guest prints two markers that the host relies on (see init):
#   NVPOOL-VM-SCRIPT-START             init is running: the kernel survived early boot
#   NVPOOL-VM-SCENARIO: NAME PASS | FAIL rc=N after Ss   one per scenario, as it ends
#   NVPOOL-VM-RESULT: PASS | FAIL ...  the verdict, printed once, just before power-off

VM_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
VM_CACHE=${NVPOOL_VM_CACHE:-${HOME:-/root}/.cache/nvpool-vm}
# The metapackage always points at the newest 6.12 build; NVPOOL_VM_KERNEL_PKG pins one.
VM_KERNEL_META=${NVPOOL_VM_KERNEL_META:-linux-image-6.12-amd64}
VM_ACCEL=${NVPOOL_VM_ACCEL:-tcg,thread=multi}
VM_MEM=${NVPOOL_VM_MEM:-2G}
VM_SMP=${NVPOOL_VM_SMP:-2}

# One boot in roughly 150 panics before init runs under TCG on this kernel; two retries
# make a spurious failure of a whole run about one in three million.
VM_BOOT_ATTEMPTS_MAX=3
# Whole-run limit for one boot, in seconds.  The guest's own watchdog fires this much
# earlier so that a hung test still reports its diagnostics before qemu is killed.
VM_TIMEOUT_DEFAULT_S=1200
VM_GUEST_WATCHDOG_MARGIN_S=90
# Every guest gets these; tests add theirs with "# vm-modules:" or --modules.
VM_BASE_MODULES=(configfs crc32c_generic)
# Every guest gets these host programs: bash runs the tests, kmod's modprobe reads
# .ko.xz files and serves the kernel's request_module() calls.
VM_BASE_BINS=(bash kmod)
# Soft-RoCE for "# vm-rdma: yes" tests: rxe and the userspace verbs/CM device nodes; the
# tools pull libibverbs.so.1 and librdmacm.so.1 in through ldd (nvpool dlopens them), the
# provider directory and its driver files are what libibverbs loads for an rxe device.
VM_RDMA_MODULES=(dummy rdma_rxe ib_uverbs rdma_ucm crc32_generic nvme-rdma nvmet-rdma)
VM_RDMA_BINS=(ip rdma ibv_devinfo rping)
VM_RDMA_FILES=(/usr/lib/x86_64-linux-gnu/libibverbs:/usr/lib/x86_64-linux-gnu/libibverbs
    /etc/libibverbs.d:/etc/libibverbs.d)
# Where programs given by name are looked up on the host (root's PATH on Debian).
VM_HOST_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# Networking, only for tests given --guestfwd (VM_GUESTFWDS: GUESTPORT:HOSTPORT words).
# Without it the guest has no NIC at all.  With it the guest gets one virtio NIC on QEMU's
# user-mode network (slirp) with restrict=on, which drops every packet leaving the
# guest except connections to the forwarded ports of VM_NET_FWD_ADDR.  Each such
# connection runs its own socat that connects to 127.0.0.1:HOSTPORT on the host.  Not
# QEMU's "guestfwd=...-tcp:HOST:PORT" form: that is one chardev, connected once when
# QEMU starts and shared by every guest connection to the port, which cannot carry
# NVMe/TCP's separate admin and I/O queue connections (and a server that drops an idle
# connection, as nvpool-target does after 10 s without ICReq, leaves it dead).
VM_NET_GUEST_CIDR=10.0.2.15/24
VM_NET_FWD_ADDR=10.0.2.100
VM_NET_MODULES=(virtio_net)

vm_log() {
    printf 'nvpool-vm: %s\n' "$*" >&2
}

vm_die() {
    vm_log "error: $*"
    exit 1
}

# Print the name of the kernel image package to use.
vm_kernel_package() {
    if [[ -n ${NVPOOL_VM_KERNEL_PKG:-} ]]; then
        printf '%s\n' "$NVPOOL_VM_KERNEL_PKG"
        return
    fi
    local pkg
    pkg=$(vm_resolve_meta)
    if [[ -z $pkg && $EUID -eq 0 ]]; then
        vm_log "apt does not know $VM_KERNEL_META; running apt-get update"
        apt-get update -qq >&2 || vm_log "apt-get update failed"
        pkg=$(vm_resolve_meta)
    fi
    if [[ -z $pkg ]]; then
        # Offline, or apt lists missing: fall back to the newest kernel already cached.
        pkg=$(find "$VM_CACHE/kernels" -mindepth 2 -maxdepth 2 -name .complete \
            -printf '%h\n' 2>/dev/null | sed 's|.*/||' | sort -V | tail -n 1)
        [[ -n $pkg ]] || vm_die "cannot resolve $VM_KERNEL_META with apt-cache and no" \
            "kernel is cached in $VM_CACHE/kernels; enable bookworm-security or" \
            "bookworm-backports in /etc/apt/sources.list.d and run apt-get update"
        vm_log "apt cannot resolve $VM_KERNEL_META; using cached $pkg"
    fi
    printf '%s\n' "$pkg"
}

# The linux-image-* package the metapackage depends on, or nothing.
vm_resolve_meta() {
    apt-cache depends "$VM_KERNEL_META" 2>/dev/null |
        awk '$1 ~ /Depends:$/ && $2 ~ /^linux-image-[0-9]/ { print $2; exit }'
}

# Download and unpack the kernel package unless it is cached.  Sets VM_KERNEL_ROOT,
# VM_KERNEL_VERSION and VM_KERNEL_IMAGE.
vm_fetch_kernel() {
    local pkg dir tmp
    pkg=$(vm_kernel_package)
    dir=$VM_CACHE/kernels/$pkg
    if [[ ! -e $dir/.complete ]]; then
        vm_log "fetching $pkg into $dir"
        mkdir -p "$VM_CACHE/kernels"
        tmp=$(mktemp -d "$VM_CACHE/kernels/.fetch.XXXXXX")
        # The sandbox user _apt cannot write into a private temporary directory.
        (cd "$tmp" && apt-get download -q -o APT::Sandbox::User=root "$pkg" >&2) ||
            vm_die "apt-get download $pkg failed"
        dpkg -x "$tmp"/*.deb "$tmp/root"
        local kver
        kver=$(vm_single_kernel_version "$tmp/root")
        # modules.dep for the host-side dependency walk in vm_add_modules.
        depmod -b "$tmp/root" "$kver"
        touch "$tmp/root/.complete"
        rm -rf "$dir"
        mv "$tmp/root" "$dir"
        rm -rf "$tmp"
    fi
    VM_KERNEL_ROOT=$dir
    VM_KERNEL_VERSION=$(vm_single_kernel_version "$dir")
    VM_KERNEL_IMAGE=$dir/boot/vmlinuz-$VM_KERNEL_VERSION
    [[ -f $VM_KERNEL_IMAGE ]] || vm_die "no kernel image at $VM_KERNEL_IMAGE"
}

vm_single_kernel_version() {
    local versions=("$1"/lib/modules/*)
    [[ ${#versions[@]} -eq 1 && -d ${versions[0]} ]] ||
        vm_die "expected exactly one module tree under $1/lib/modules"
    printf '%s\n' "${versions[0]##*/}"
}

# Create the directory skeleton of a usr-merged root, like the Debian 12 host, so that
# library paths printed by ldd on the host are valid in the guest.
vm_init_root() {
    local root=$1 d
    mkdir -p "$root"/{usr/bin,usr/sbin,usr/lib,usr/lib64,usr/local/bin,etc,dev,proc,sys}
    mkdir -p "$root"/{tmp,run,mnt,root,nvpool/lib}
    for d in bin sbin lib lib64; do
        ln -s "usr/$d" "$root/$d"
    done
}

# Copy the shared libraries that $2 needs into root $1 (no-op for static programs).
vm_add_libs() {
    local root=$1 prog=$2 out lib
    if ! out=$(ldd "$prog" 2>&1); then
        [[ $out == *"not a dynamic executable"* ]] && return 0
        vm_die "ldd $prog: $out"
    fi
    [[ $out == *"statically linked"* ]] && return 0
    if [[ $out == *"not found"* ]]; then
        vm_die "missing libraries for $prog: $(grep 'not found' <<<"$out" | tr -s ' \t' ' ')"
    fi
    while read -r lib; do
        [[ -e $root$lib ]] || install -D -m 0755 "$lib" "$root$lib"
    done < <(awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' <<<"$out")
}

# glibc dlopens libgcc_s at run time (thread cancellation, unwinding); ldd cannot see it.
vm_add_libgcc() {
    local root=$1 lib
    # awk reads to the end: exiting early would let ldconfig die of SIGPIPE now and then,
    # which pipefail turns into a silent exit 141 of the whole harness.
    lib=$(PATH=$VM_HOST_PATH ldconfig -p |
        awk '$1 == "libgcc_s.so.1" && /x86-64/ && !found { print $NF; found = 1 }')
    [[ -n $lib ]] || vm_die "libgcc_s.so.1 not found on the host (package libgcc-s1)"
    [[ -e $root$lib ]] || install -D -m 0755 "$lib" "$root$lib"
}

# Add a program.  A bare name is a host tool: looked up in $VM_HOST_PATH and installed at
# the same path.  Anything with a slash is a file (a project binary): installed in
# /usr/local/bin under its own name.
vm_add_bin() {
    local root=$1 spec=$2 src dest
    if [[ $spec == */* ]]; then
        [[ -f $spec && -x $spec ]] || vm_die "--bin $spec: not an executable file"
        src=$spec
        dest=/usr/local/bin/${spec##*/}
    else
        src=$(PATH=$VM_HOST_PATH command -v "$spec") ||
            vm_die "host program '$spec' not found; install its Debian package"
        dest=$src
    fi
    install -D -m 0755 "$src" "$root$dest"
    vm_add_libs "$root" "$src"
}

# Add a file or directory: SRC:DEST, DEST absolute inside the guest.
vm_add_file() {
    local root=$1 spec=$2 src dest
    [[ $spec == *:/* ]] || vm_die "--file $spec: expected SRC:/ABSOLUTE/DEST"
    src=${spec%%:/*}
    dest=/${spec#*:/}
    [[ -e $src ]] || vm_die "--file $spec: $src does not exist"
    mkdir -p "$root$(dirname "$dest")"
    cp -RL --preserve=mode "$src" "$root$dest"
}

# Add kernel modules $2.. and everything they depend on, then index them.
vm_add_modules() {
    local root=$1 mod line path
    shift
    local -A seen=()
    for mod in "$@"; do
        while read -r line; do
            case $line in
                insmod\ *)
                    path=${line#insmod }
                    path=${path%% *}
                    [[ -n ${seen[$path]:-} ]] && continue
                    seen[$path]=1
                    install -D -m 0644 "$path" "$root/${path#"$VM_KERNEL_ROOT"/}"
                    ;;
                builtin\ *) ;;
                *) vm_die "unexpected modprobe output for $mod: $line" ;;
            esac
        done < <(modprobe -d "$VM_KERNEL_ROOT" -S "$VM_KERNEL_VERSION" \
            --show-depends "$mod" 2>&1 || echo "modprobe-failed $mod")
    done
    local moddir=lib/modules/$VM_KERNEL_VERSION
    mkdir -p "$root/$moddir"
    cp "$VM_KERNEL_ROOT/$moddir"/modules.{builtin,builtin.modinfo,order} "$root/$moddir/"
    depmod -b "$root" "$VM_KERNEL_VERSION"
}

# Link every busybox applet whose name no real program already took.
vm_add_busybox() {
    local root=$1 bb applet
    bb=$(PATH=$VM_HOST_PATH command -v busybox) ||
        vm_die "busybox not found; install busybox-static"
    vm_add_libs "$root" "$bb"
    install -m 0755 "$bb" "$root/usr/bin/busybox"
    while read -r applet; do
        [[ -e $root/usr/bin/$applet || -e $root/usr/sbin/$applet ]] && continue
        ln -s busybox "$root/usr/bin/$applet"
    done < <("$bb" --list)
}

vm_add_kmod_links() {
    local root=$1 tool
    for tool in modprobe insmod rmmod lsmod modinfo depmod; do
        ln -sf ../bin/kmod "$root/usr/sbin/$tool"
    done
}

# Read "# vm-KEY: words" lines from a guest script.
vm_script_directive() {
    local script=$1 key=$2
    sed -n "s/^# vm-$key:[[:space:]]*//p" "$script" | tr '\n' ' '
}

# Write the initramfs to $1.  Uses the arrays VM_MODULES, VM_BINS, VM_FILES,
# VM_GUESTFWDS, VM_SCRIPTS (the scenarios, run in this order) and VM_SCENARIO_ENVS
# (each scenario's KEY=VALUE words, one a line), and VM_GUEST_TIMEOUT_S.
vm_build_initramfs() {
    local out=$1 root bin file kv
    root=$(mktemp -d "${TMPDIR:-/tmp}/nvpool-vm-root.XXXXXX")
    vm_init_root "$root"
    for bin in "${VM_BASE_BINS[@]}" "${VM_BINS[@]}"; do
        vm_add_bin "$root" "$bin"
    done
    vm_add_kmod_links "$root"
    vm_add_libgcc "$root"
    vm_add_busybox "$root"
    vm_add_modules "$root" "${VM_BASE_MODULES[@]}" "${VM_MODULES[@]}"
    [[ ! -f /etc/mke2fs.conf ]] || cp /etc/mke2fs.conf "$root/etc/"
    mkdir -p "$root/etc/modprobe.d"
    sed -n 's/^# vm-modprobe-options:[[:space:]]*/options /p' "${VM_SCRIPTS[@]}" |
        sort -u >"$root/etc/modprobe.d/nvpool-vm.conf"
    install -m 0755 "$VM_DIR/init" "$root/init"
    cp "$VM_DIR"/guest/lib/*.sh "$VM_DIR"/../lib/local-cluster.sh "$root/nvpool/lib/"
    for file in "${VM_FILES[@]}"; do
        vm_add_file "$root" "$file"
    done
    # Read by init (busybox ash): plain words only.
    {
        printf 'NVPOOL_VM_MODULES="%s"\n' "${VM_BASE_MODULES[*]} ${VM_MODULES[*]}"
        printf 'NVPOOL_VM_GUEST_TIMEOUT_S=%d\n' "$VM_GUEST_TIMEOUT_S"
        printf 'NVPOOL_VM_SCENARIOS="%s"\n' "$(seq -s ' ' 1 "${#VM_SCRIPTS[@]}")"
    } >"$root/nvpool/init.conf"
    local i dir
    for i in "${!VM_SCRIPTS[@]}"; do
        dir=$root/nvpool/tests/$((i + 1))
        mkdir -p "$dir"
        install -m 0644 "${VM_SCRIPTS[i]}" "$dir/test.sh"
        basename "${VM_SCRIPTS[i]}" .sh >"$dir/name"
        # Read by bash before the scenario's script runs.
        {
            printf 'export NVPOOL_VM_TEST=%q\n' "$(basename "${VM_SCRIPTS[i]}")"
            if ((${#VM_GUESTFWDS[@]})); then
                printf 'export NVPOOL_VM_NET_CIDR=%q NVPOOL_VM_FWD_ADDR=%q\n' \
                    "$VM_NET_GUEST_CIDR" "$VM_NET_FWD_ADDR"
            fi
            while IFS= read -r kv; do
                [[ -z $kv ]] || printf 'export %s=%q\n' "${kv%%=*}" "${kv#*=}"
            done <<<"${VM_SCENARIO_ENVS[i]}"
        } >"$dir/test.env"
    done
    # Uncompressed: the modules are xz already and gunzip under TCG costs seconds.
    (cd "$root" && find . -print0 | LC_ALL=C sort -z |
        cpio --null --create --format=newc --owner=0:0 --quiet) >"$out"
    rm -rf "$root"
}

# Print qemu's network options, one word a line: "-nic none", or one restricted
# user-mode NIC carrying a guestfwd rule per VM_GUESTFWDS entry (see VM_NET_FWD_ADDR).
vm_nic_args() {
    local nic fwd
    if ((${#VM_GUESTFWDS[@]} == 0)); then
        printf '%s\n' -nic none
        return
    fi
    nic=user,model=virtio-net-pci,restrict=on,ipv6=off
    for fwd in "${VM_GUESTFWDS[@]}"; do
        # slirp runs the command without a shell, its stdin and stdout (and stderr, hence
        # -lf) being the guest connection.
        nic+=",guestfwd=tcp:$VM_NET_FWD_ADDR:${fwd%%:*}-cmd:socat -lf /dev/null"
        nic+=" STDIO TCP4:127.0.0.1:${fwd#*:}"
    done
    printf '%s\n' -nic "$nic"
}

# Boot once, streaming the console to stdout and appending it to $2.  Returns 0 on PASS,
# 1 on a failed test, 2 when the guest died before its init started (worth a retry).
vm_boot_once() {
    local initrd=$1 log=$2 timeout_s=$3 start rc console nic_args
    start=$(($(stat -c %s "$log") + 1))
    mapfile -t nic_args < <(vm_nic_args)
    set +e
    timeout -k 15 "$timeout_s" qemu-system-x86_64 \
        -nodefaults -no-user-config -accel "$VM_ACCEL" -cpu max -m "$VM_MEM" \
        -smp "$VM_SMP" -display none -serial stdio -monitor none "${nic_args[@]}" -no-reboot \
        -kernel "$VM_KERNEL_IMAGE" -initrd "$initrd" \
        -append "console=ttyS0 panic=-1 quiet ${NVPOOL_VM_APPEND:-}" \
        </dev/null 2>&1 | sed -u 's/\r$//' | tee -a "$log"
    rc=${PIPESTATUS[0]}
    set -e
    if [[ $rc -eq 124 || $rc -eq 137 ]]; then
        vm_log "qemu killed after ${timeout_s}s"
    fi
    console=$(tail -c "+$start" "$log")
    if grep -qx 'NVPOOL-VM-RESULT: PASS' <<<"$console"; then
        return 0
    elif grep -q -e '^NVPOOL-VM-RESULT: ' -e '^NVPOOL-VM-SCRIPT-START$' <<<"$console"; then
        return 1
    fi
    return 2
}

# Boot, retrying boots that died before init started.  Returns 0 only on PASS.
vm_boot() {
    local initrd=$1 log=$2 timeout_s=$3 attempt rc
    for ((attempt = 1; attempt <= VM_BOOT_ATTEMPTS_MAX; attempt++)); do
        printf '=== nvpool-vm: boot attempt %d of %d ===\n' "$attempt" "$VM_BOOT_ATTEMPTS_MAX" |
            tee -a "$log"
        rc=0
        vm_boot_once "$initrd" "$log" "$timeout_s" || rc=$?
        case $rc in
            0) return 0 ;;
            1) return 1 ;;
            *) vm_log "guest died before its init started (attempt $attempt)" ;;
        esac
    done
    vm_log "giving up after $VM_BOOT_ATTEMPTS_MAX early deaths"
    return 1
}
