#!/bin/sh
# Installs every Ruby the test suite profiles, caching them under
# ${RPROF_CACHE:-/var/cache/rprof} so later runs take seconds:
#   host   Debian 12's ruby 3.1 (apt)
#   2.7    Debian 11 chroot        3.3  Debian 13 chroot
#   3.4    Debian sid chroot with ruby3.4 from experimental
#   static ruby 3.1 built from Debian's source with --disable-shared
# Usage: scripts/setup-rubies.sh [host|2.7|3.3|3.4|static|all]...
set -eu
CACHE=${RPROF_CACHE:-/var/cache/rprof}
MIRROR=${RPROF_DEBIAN_MIRROR:-http://deb.debian.org/debian}
export DEBIAN_FRONTEND=noninteractive
mkdir -p "$CACHE"

log() { echo "setup-rubies: $*" >&2; }

chroot_ruby() { # name suite
    dir="$CACHE/chroot-$1"
    if [ -f "$dir/.rprof-ready" ]; then return 0; fi
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    log "debootstrap $2 into $dir (a few minutes, once)"
    rm -rf "$dir"
    debootstrap --variant=minbase --include=ruby "$2" "$dir" "$MIRROR" >"$CACHE/debootstrap-$1.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap-$1.log" >&2; exit 1; }
    touch "$dir/.rprof-ready"
}

chroot_ruby34() {
    dir="$CACHE/chroot-3.4"
    if [ -f "$dir/.rprof-ready" ]; then return 0; fi
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    log "debootstrap sid + ruby3.4 from experimental into $dir (a few minutes, once)"
    rm -rf "$dir"
    debootstrap --variant=minbase sid "$dir" "$MIRROR" >"$CACHE/debootstrap-3.4.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap-3.4.log" >&2; exit 1; }
    echo "deb $MIRROR experimental main" >"$dir/etc/apt/sources.list.d/experimental.list"
    chroot "$dir" apt-get -qq -o Acquire::Check-Valid-Until=false update >>"$CACHE/debootstrap-3.4.log" 2>&1
    chroot "$dir" apt-get -qq -o Acquire::Check-Valid-Until=false install -y -t experimental ruby3.4 \
        >>"$CACHE/debootstrap-3.4.log" 2>&1 || { tail -20 "$CACHE/debootstrap-3.4.log" >&2; exit 1; }
    [ -x "$dir/usr/bin/ruby3.4" ] && [ ! -e "$dir/usr/bin/ruby" ] && ln -s ruby3.4 "$dir/usr/bin/ruby"
    touch "$dir/.rprof-ready"
}

static_ruby() {
    prefix="$CACHE/ruby-3.1-static"
    if [ -x "$prefix/bin/ruby" ] && [ -f "$prefix/.rprof-ready" ]; then return 0; fi
    log "building a static ruby 3.1 from Debian's source into $prefix (about 5 minutes, once)"
    if ! grep -rqs '^Types: deb-src' /etc/apt/sources.list.d/rprof-src.sources; then
        cat >/etc/apt/sources.list.d/rprof-src.sources <<SRC
Types: deb-src
URIs: $MIRROR
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
        apt-get update -qq
    fi
    apt-get install -y -qq dpkg-dev autoconf bison libssl-dev libyaml-dev libffi-dev libgmp-dev zlib1g-dev >/dev/null
    work="$CACHE/build-static"
    rm -rf "$work" && mkdir -p "$work"
    (cd "$work" && apt-get source -qq --download-only ruby3.1 >/dev/null 2>&1 && tar xf ruby3.1_*.orig.tar.*)
    src=$(find "$work" -maxdepth 1 -type d -name 'ruby-3.1*' | head -1)
    (cd "$src" && ./configure --prefix="$prefix" --disable-shared --disable-install-doc >"$work/configure.log" 2>&1 \
        && make -j"$(nproc)" >"$work/make.log" 2>&1 \
        && make install HAVE_BASERUBY=no >"$work/install.log" 2>&1) \
        || { tail -30 "$work"/*.log >&2; exit 1; }
    rm -rf "$work"
    touch "$prefix/.rprof-ready"
}

host_ruby() {
    if command -v ruby >/dev/null && ruby -e 'exit(RUBY_VERSION.start_with?("3.1") ? 0 : 1)'; then return 0; fi
    apt-get install -y -qq ruby >/dev/null
}

[ $# -eq 0 ] && set -- all
for what in "$@"; do
    case "$what" in
        host) host_ruby ;;
        2.7) chroot_ruby 2.7 bullseye ;;
        3.3) chroot_ruby 3.3 trixie ;;
        3.4) chroot_ruby34 ;;
        static) static_ruby ;;
        all) host_ruby; chroot_ruby 2.7 bullseye; chroot_ruby 3.3 trixie; chroot_ruby34; static_ruby ;;
        *) echo "setup-rubies: unknown '$what' (host, 2.7, 3.3, 3.4, static, all)" >&2; exit 2 ;;
    esac
done
