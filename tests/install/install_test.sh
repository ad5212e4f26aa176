#!/usr/bin/env bash
# Install test: stage `cmake --install` of a build tree and check what a host
# gets: the binaries run, the systemd units name the installed dedupd and pass
# `systemd-analyze verify`, the example config parses, and the installed
# dedupd serves a volume over NBD and exits 0 on SIGTERM.
#
#   tests/install/install_test.sh BUILD_DIR SOURCE_DIR [CMAKE]
#
# Registered in tests/CMakeLists.txt (label "install"). Needs systemd-analyze
# (package systemd) and qemu-img (qemu-utils): fails when either is missing.
#
# Nothing is written outside one temporary directory: the install goes to
# DESTDIR=$tmp/root with --prefix $tmp/stage, and $tmp/stage is then a
# symlink to $tmp/root$tmp/stage, so the units' ExecStart (configured with
# the install-time prefix, never DESTDIR) names the staged dedupd.
set -euo pipefail

if (($# < 2)); then
  echo "usage: $0 BUILD_DIR SOURCE_DIR [CMAKE]" >&2
  exit 2
fi
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
cmake_bin=${3:-cmake}

fail() {
  echo "install_test: FAIL: $*" >&2
  exit 1
}
note() { echo "install_test: $*"; }

for tool in systemd-analyze qemu-img "$cmake_bin"; do
  command -v "$tool" >/dev/null 2>&1 ||
    fail "$tool is not installed (scripts/install-deps installs systemd and qemu-utils)"
done

tmp=$(mktemp -d "${TMPDIR:-/tmp}/dede-install.XXXXXX")
dedupd_pid=
cleanup() {
  if [[ -n $dedupd_pid ]] && kill -0 "$dedupd_pid" 2>/dev/null; then
    kill -KILL "$dedupd_pid" 2>/dev/null || true
    wait "$dedupd_pid" 2>/dev/null || true
  fi
  if [[ -n ${notify_pid:-} ]] && kill -0 "$notify_pid" 2>/dev/null; then
    kill -KILL "$notify_pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT

# ------------------------------------------------------------------ install
stage=$tmp/stage
root=$tmp/root
if ! DESTDIR=$root "$cmake_bin" --install "$build" --prefix "$stage" >"$tmp/install.log" 2>&1; then
  cat "$tmp/install.log" >&2
  fail "cmake --install $build failed (are dede, dedupd and dede-vmgen built?)"
fi
[[ -d $root$stage ]] || fail "nothing was installed under DESTDIR$stage"
ln -s "$root$stage" "$stage"
note "installed to $stage (DESTDIR staging)"

bin=$stage/bin
doc=$stage/share/doc/dede
for f in "$bin/dede" "$bin/dedupd" "$bin/dede-vmgen"; do
  [[ -f $f && -x $f ]] || fail "$f is missing or not executable"
done
for f in "$doc/dedupd.conf.example" "$doc/README.md"; do
  [[ -f $f ]] || fail "$f is missing"
done
shopt -s nullglob
for md in "$src"/docs/*.md; do
  [[ -f $doc/docs/$(basename "$md") ]] || fail "$doc/docs/$(basename "$md") is missing"
done
shopt -u nullglob

# The unit directory is a cache variable (relative to the prefix or
# absolute): find the units wherever under DESTDIR they went.
unit=$(find "$root" -name dedupd.service -type f | head -n1)
[[ -n $unit ]] || fail "dedupd.service was not installed"
unitdir=$(dirname "$unit")
[[ -f $unitdir/dedupd@.service ]] || fail "dedupd@.service was not installed next to dedupd.service"
note "units in ${unitdir#"$root"}"

# ------------------------------------------------------------ the binaries
out=$("$bin/dede" --version) || fail "dede --version failed"
[[ $out == dede\ * ]] || fail "dede --version printed '$out'"
out=$("$bin/dedupd" --version) || fail "dedupd --version failed"
[[ $out == dedupd\ * ]] || fail "dedupd --version printed '$out'"
"$bin/dede-vmgen" --help >"$tmp/vmgen-help" || fail "dede-vmgen --help failed"
grep -q -- "--out" "$tmp/vmgen-help" || fail "dede-vmgen --help does not describe --out"

# --------------------------------------------------------------- the units
for u in dedupd.service dedupd@.service; do
  grep -Eq "^ExecStart=$bin/dedupd --config /" "$unitdir/$u" ||
    fail "$u: ExecStart does not run $bin/dedupd --config: $(grep '^ExecStart=' "$unitdir/$u")"
  grep -q '@[A-Za-z_]*@' <(grep -v '^#' "$unitdir/$u") && fail "$u: unconfigured @VARIABLE@ left"
  for key in Type=notify NotifyAccess=main KillSignal=SIGTERM Restart=on-failure RuntimeDirectory= StateDirectory=dede \
    NoNewPrivileges=yes ProtectSystem=full ProtectHome=yes PrivateTmp=yes; do
    grep -q "^$key" "$unitdir/$u" || fail "$u: no $key"
  done
  # dedupd opens the LUN's block device.
  grep -q '^PrivateDevices=yes' "$unitdir/$u" && fail "$u: PrivateDevices=yes hides the LUN"
done
# The template also as an instance, with %i expanded. Any line of
# systemd-analyze's output about our units is a failure (it exits 0 on
# warnings such as unknown keys).
cp "$unitdir/dedupd@.service" "$tmp/dedupd@.service"
verify_rc=0
systemd-analyze verify --man=no "$unitdir/dedupd.service" "$unitdir/dedupd@.service" \
  "$tmp/dedupd@check.service" >"$tmp/verify.log" 2>&1 || verify_rc=$?
if ((verify_rc != 0)) || grep -q dedupd "$tmp/verify.log"; then
  cat "$tmp/verify.log" >&2
  fail "systemd-analyze verify complains about the units (exit $verify_rc)"
fi
note "systemd-analyze verify: clean"

# ------------------------------------------------- the example config parses
# dedupd's options, from its --help ("  --volume VOL ...", "  -h [ --help ]").
"$bin/dedupd" --help >"$tmp/dedupd-help"
mapfile -t options < <(sed -nE 's/^  (-[a-zA-Z] \[ )?--([a-z0-9-]+).*/\2/p' "$tmp/dedupd-help" | sort -u)
((${#options[@]} > 5)) || fail "could not read dedupd's options from its --help"
has_option() {
  local o
  for o in "${options[@]}"; do [[ $o == "$1" ]] && return 0; done
  return 1
}
example=$doc/dedupd.conf.example
# Every option is documented in the example (as `name =` or `#name =`).
for o in "${options[@]}"; do
  case $o in help | version | config) continue ;; esac
  grep -Eq "^#? ?$o =" "$example" || fail "dedupd.conf.example does not document --$o"
done
# Every option the example names exists.
while read -r name; do
  has_option "$name" || fail "dedupd.conf.example names '$name', which is not a dedupd option"
done < <(sed -nE 's/^#? ?([a-z][a-z0-9-]*) =.*/\1/p' "$example" | sort -u)
# The staged config: the example with every default line (`#name = value`)
# of an option dedupd has uncommented, so dedupd parses all of them. The
# required settings (volume, host-id, socket) and the paths are overridden
# on the command line, which wins over the file.
conf=$tmp/dedupd.conf
: >"$conf"
while IFS= read -r line; do
  if [[ $line =~ ^#([a-z][a-z0-9-]*)\ =(.*)$ ]] && has_option "${BASH_REMATCH[1]}"; then
    line=${line#\#}
  fi
  printf '%s\n' "$line" >>"$conf"
done <"$example"
uncommented=$(grep -cE '^[a-z]' "$conf" || true)
note "staged config: $uncommented option lines set"

# ------------------------------------------------- a volume served over NBD
vol=$tmp/vol.img
sock=$tmp/nbd.sock
truncate -s 64M "$vol"
"$bin/dede" format "$vol" >"$tmp/format.log" || fail "dede format $vol failed"
"$bin/dede" create "$vol" vm1 --size 4M || fail "dede create failed"
"$bin/dede" ls "$vol" | grep -q vm1 || fail "dede ls does not list vm1"

extra=(--control "$tmp/dedupd.ctl" --history "$tmp/history.db" --metrics-port 0)
# systemd's notification socket, played by python3: Type=notify units need
# dedupd to report READY=1 once it serves.
notify_sock=$tmp/notify.sock
python3 - "$notify_sock" "$tmp/notify.log" <<'PY' &
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1])
s.settimeout(30)
with open(sys.argv[2], "w") as out:
    try:
        while True:
            msg = s.recv(4096).decode()
            out.write(msg + "\n---\n")
            out.flush()
            if "STOPPING=1" in msg:
                break
    except socket.timeout:
        pass
PY
notify_pid=$!
for ((i = 0; i < 50; i++)); do
  [[ -S $notify_sock ]] && break
  sleep 0.1
done
NOTIFY_SOCKET=$notify_sock "$bin/dedupd" --volume "$vol" --host-id 1 --socket "$sock" \
  ${extra[@]+"${extra[@]}"} --config "$conf" 2>"$tmp/dedupd.log" &
dedupd_pid=$!
for ((i = 0; i < 100; i++)); do
  [[ -S $sock ]] && break
  kill -0 "$dedupd_pid" 2>/dev/null || break
  sleep 0.1
done
if [[ ! -S $sock ]]; then
  cat "$tmp/dedupd.log" >&2
  fail "the installed dedupd did not create its socket $sock within 10 s"
fi
if ! timeout 20 qemu-img info "nbd+unix:///vm1?socket=$sock" >"$tmp/qemu-img.log" 2>&1; then
  cat "$tmp/qemu-img.log" "$tmp/dedupd.log" >&2
  fail "qemu-img info on nbd+unix:///vm1 failed"
fi
grep -q "virtual size: 4 MiB" "$tmp/qemu-img.log" || {
  cat "$tmp/qemu-img.log" >&2
  fail "qemu-img info does not show vm1's 4 MiB"
}
kill -TERM "$dedupd_pid"
rc=0
wait "$dedupd_pid" || rc=$?
dedupd_pid=
if ((rc != 0)); then
  cat "$tmp/dedupd.log" >&2
  fail "dedupd exited $rc on SIGTERM (expected 0)"
fi
grep -q "^dedupd: info: stopped" "$tmp/dedupd.log" || {
  cat "$tmp/dedupd.log" >&2
  fail "dedupd's log has no 'dedupd: info: stopped' line"
}
note "dedupd served vm1 and exited 0 on SIGTERM"
wait "$notify_pid" || true
grep -q "^READY=1" "$tmp/notify.log" || {
  cat "$tmp/notify.log" >&2
  fail "dedupd did not send READY=1 to \$NOTIFY_SOCKET"
}
grep -q "^STOPPING=1" "$tmp/notify.log" || fail "dedupd did not send STOPPING=1 on SIGTERM"
note "dedupd notified systemd: READY=1, then STOPPING=1"

# ------------------------------------------------------ journald priorities
# With stderr the stream $JOURNAL_STREAM names, lines carry "<3>" etc.;
# with a JOURNAL_STREAM that is not stderr (inherited, stderr redirected),
# they do not.
jlog=$tmp/journal.log
: >"$jlog"
stream=$(stat -c '%d:%i' "$jlog")
JOURNAL_STREAM=$stream "$bin/dedupd" --volume "$tmp/missing.img" --host-id 1 \
  --socket "$tmp/j.sock" ${extra[@]+"${extra[@]}"} 2>>"$jlog" && fail "dedupd opened a missing volume"
grep -q '^<3>error: cannot open volume' "$jlog" || {
  cat "$jlog" >&2
  fail "under the journal dedupd's error line does not start with <3>"
}
JOURNAL_STREAM=0:0 "$bin/dedupd" --volume "$tmp/missing.img" --host-id 1 \
  --socket "$tmp/j.sock" ${extra[@]+"${extra[@]}"} 2>"$jlog" && fail "dedupd opened a missing volume"
grep -q '^dedupd: error: cannot open volume' "$jlog" || {
  cat "$jlog" >&2
  fail "off the journal dedupd's error line is not 'dedupd: error: ...'"
}
note "log lines carry syslog priorities only on the journal"

note "PASS"
