# Sourced by the bench scripts that need an iSCSI LUN: a private tgtd on
# 127.0.0.1 (its own control port and socket, so it never touches a system
# tgtd), one target, LUNs backed by files. Needs log() and die() from the
# caller. After tgtd_start, tgtd_url LUN is the LUN's iscsi:// URL.
#
#   tgtd_start LOG       start tgtd, wait until it answers, create target 1
#   tgtd_add_lun N FILE  LUN N backed by FILE (O_DIRECT unless TGTD_DIRECT=0)
#   tgtd_tune            negotiate like a typical array (TGTD_TUNE=0: tgtd's
#                        defaults: 8 KiB data segments, every write crawls
#                        through R2Ts)
#   tgtd_wait_portal     wait until the portal accepts TCP connections
#   tgtd_stop            delete the target and the system; tgtd exits
#                        (safe to call when nothing was started: for traps)

tgtd_pid=""
tgt_run=""
tgt_lld=""
tgt_port=""
tgt_iqn=""

tgtadm_() { TGT_IPC_SOCKET=$tgt_run/socket tgtadm -C "$tgt_lld" --lld iscsi "$@"; }

tgtd_start() {
  local logfile=$1 i
  command -v tgtd >/dev/null || PATH=$PATH:/usr/sbin
  command -v tgtd >/dev/null || die "tgtd not found (Debian package 'tgt')"
  tgt_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  tgt_lld=$((1000 + RANDOM % 30000))
  tgt_run=$(mktemp -d /tmp/dede-tgtd.XXXXXX)  # short path for the control socket
  tgt_iqn="iqn.2026-11.org.dede.bench:$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')"
  log "+ TGT_IPC_SOCKET=$tgt_run/socket tgtd -f -C $tgt_lld --iscsi portal=127.0.0.1:$tgt_port"
  TGT_IPC_SOCKET=$tgt_run/socket tgtd -f -C "$tgt_lld" --iscsi "portal=127.0.0.1:$tgt_port" \
    >"$logfile" 2>&1 &
  tgtd_pid=$!
  for i in $(seq 100); do
    tgtadm_ --op show --mode target >/dev/null 2>&1 && break
    kill -0 "$tgtd_pid" 2>/dev/null || die "tgtd exited: $(tail -5 "$logfile")"
    [[ $i == 100 ]] && die "tgtd did not answer tgtadm within 10 s"
    sleep 0.1
  done
  log "+ tgtadm --op new --mode target --tid 1 -T $tgt_iqn"
  tgtadm_ --op new --mode target --tid 1 -T "$tgt_iqn"
  tgtadm_ --op bind --mode target --tid 1 -I ALL
}

tgtd_add_lun() {
  local lun=$1 backing=$2 flags=()
  [[ ${TGTD_DIRECT:-1} == 1 ]] && flags=(--bsoflags direct)
  log "+ tgtadm --op new --mode logicalunit --tid 1 --lun $lun -b $backing ${flags[*]}"
  tgtadm_ --op new --mode logicalunit --tid 1 --lun "$lun" -b "$backing" "${flags[@]}"
}

tgtd_tune() {
  local kv
  [[ ${TGTD_TUNE:-1} == 1 ]] || return 0
  for kv in MaxRecvDataSegmentLength=262144 MaxXmitDataSegmentLength=262144 \
    FirstBurstLength=262144 MaxBurstLength=1048576 InitialR2T=No ImmediateData=Yes; do
    log "+ tgtadm --op update --mode target --tid 1 --name ${kv%%=*} --value ${kv#*=}"
    tgtadm_ --op update --mode target --tid 1 --name "${kv%%=*}" --value "${kv#*=}"
  done
}

tgtd_wait_portal() {
  local i
  for i in $(seq 50); do
    (exec 3<>"/dev/tcp/127.0.0.1/$tgt_port") 2>/dev/null && return 0
    sleep 0.1
  done
  die "tgtd does not accept connections on 127.0.0.1:$tgt_port"
}

tgtd_url() { echo "iscsi://127.0.0.1:$tgt_port/$tgt_iqn/$1"; }

tgtd_stop() {
  if [[ -n $tgtd_pid ]] && kill -0 "$tgtd_pid" 2>/dev/null; then
    # tgtd ignores SIGTERM while it has targets: delete them, then the system.
    tgtadm_ --op delete --force --mode target --tid 1 >/dev/null 2>&1
    tgtadm_ --op delete --mode system >/dev/null 2>&1
    for _ in $(seq 50); do kill -0 "$tgtd_pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$tgtd_pid" 2>/dev/null; then kill -KILL "$tgtd_pid" 2>/dev/null; fi
    wait "$tgtd_pid" 2>/dev/null
  fi
  tgtd_pid=""
  [[ -n $tgt_run ]] && rm -rf "$tgt_run"
  tgt_run=""
  return 0
}
