#!/bin/sh
# Packages the stripped binary DIST/rprof as DIST/rprof_VERSION_amd64.deb:
# the binary, its man pages and its bash, zsh and fish completions, made by
# the binary itself from its command-line definition, and the agent's
# systemd unit with its settings, and its Kubernetes DaemonSet (packaging/).
# dpkg-deb only.
#   scripts/make-deb.sh DIST VERSION
set -eu
DIST=$1
VERSION=$2
PKG=$DIST/pkg
rm -rf "$PKG"
mkdir -p "$PKG/DEBIAN" "$PKG/usr/bin" "$PKG/usr/share/man/man1" \
    "$PKG/usr/share/bash-completion/completions" "$PKG/usr/share/zsh/vendor-completions" \
    "$PKG/usr/share/fish/vendor_completions.d" "$PKG/usr/share/doc/rprof"
install -m 0755 "$DIST/rprof" "$PKG/usr/bin/rprof"
# `rprof agent` as a service, not enabled: its push URL comes first.
mkdir -p "$PKG/lib/systemd/system" "$PKG/etc/default"
install -m 0644 packaging/rprof-agent.service "$PKG/lib/systemd/system/rprof-agent.service"
install -m 0644 packaging/rprof-agent.default "$PKG/etc/default/rprof-agent"
# On Kubernetes: the DaemonSet and the image it runs, with the same CPU limit.
install -m 0644 packaging/rprof-agent.daemonset.yaml packaging/Dockerfile "$PKG/usr/share/doc/rprof/"
"$DIST/rprof" generate man "$PKG/usr/share/man/man1"
gzip -9n "$PKG"/usr/share/man/man1/*.1
"$DIST/rprof" generate completions bash > "$PKG/usr/share/bash-completion/completions/rprof"
"$DIST/rprof" generate completions zsh > "$PKG/usr/share/zsh/vendor-completions/_rprof"
"$DIST/rprof" generate completions fish > "$PKG/usr/share/fish/vendor_completions.d/rprof.fish"
cat > "$PKG/usr/share/doc/rprof/copyright" <<COPYRIGHT
rprof: a Ruby-aware sampling profiler for Linux, built on eBPF.
License: MIT OR Apache-2.0
COPYRIGHT
echo /etc/default/rprof-agent > "$PKG/DEBIAN/conffiles"
SIZE=$(du -sk "$PKG/usr" "$PKG/lib" "$PKG/etc" | awk '{s += $1} END {print s}')
cat > "$PKG/DEBIAN/control" <<CONTROL
Package: rprof
Version: $VERSION
Architecture: amd64
Maintainer: rprof developers <rprof@localhost>
Depends: libc6 (>= 2.34)
Installed-Size: $SIZE
Section: devel
Priority: optional
Description: Ruby-aware sampling profiler for Linux, built on eBPF
 rprof records where a running Ruby application spends its CPU time, or
 which Ruby code makes a given system call, from each thread's own stack,
 with exact lines, across forked workers, with native and kernel frames.
 Needs Linux 5.17+ with BTF, and root or CAP_BPF, CAP_PERFMON and
 CAP_SYS_PTRACE.
CONTROL
dpkg-deb --root-owner-group --build "$PKG" "$DIST/rprof_${VERSION}_amd64.deb" >/dev/null
rm -rf "$PKG"
echo "$DIST/rprof_${VERSION}_amd64.deb"
