#!/bin/sh
# Installs every Ruby the test suite profiles, caching them under
# ${RPROF_CACHE:-/var/cache/rprof} so later runs take seconds:
#   host   Debian 12's ruby 3.1 (apt)
#   2.7    Debian 11 chroot        3.3  Debian 13 chroot
#   3.4    Debian sid chroot with ruby3.4 from experimental
#   static ruby 3.1 built from Debian's source with --disable-shared
#   3.3-yjit  ruby 3.3 built from Debian 13's source with --enable-shared --enable-yjit
#   3.3-fp    ruby 3.3 built from the same source with frame pointers, as
#             Ubuntu 24.04+ and Fedora 38+ build theirs
# Each chroot also gets ruby-dev and gcc, to build the tests' C extension.
#   server  a Debian 12 chroot as a production server has it: Ruby and man,
#           no build tools, no libelf (where the release binary and .deb are tried)
# Usage: scripts/setup-rubies.sh [host|2.7|3.3|3.4|static|3.3-yjit|3.3-fp|server|all]...
set -eu
CACHE=${RPROF_CACHE:-/var/cache/rprof}
MIRROR=${RPROF_DEBIAN_MIRROR:-http://deb.debian.org/debian}
export DEBIAN_FRONTEND=noninteractive
mkdir -p "$CACHE"

log() { echo "setup-rubies: $*" >&2; }

chroot_ruby() { # name suite [packages, default ruby]
    dir="$CACHE/chroot-$1"
    if [ -f "$dir/.rprof-ready" ]; then return 0; fi
    command -v debootstrap >/dev/null || apt-get install -y -qq debootstrap >/dev/null
    log "debootstrap $2 with ${3:-ruby} into $dir (a few minutes, once)"
    rm -rf "$dir"
    debootstrap --variant=minbase --include="${3:-ruby}" "$2" "$dir" "$MIRROR" >"$CACHE/debootstrap-$1.log" 2>&1 \
        || { tail -20 "$CACHE/debootstrap-$1.log" >&2; exit 1; }
    touch "$dir/.rprof-ready"
}

# chroot_dev NAME [apt options]: ruby-dev, gcc and make in a chroot, once
# (the --native tests build a C extension with the chroot's own mkmf).
chroot_dev() {
    dir="$CACHE/chroot-$1"
    shift
    if [ -f "$dir/.rprof-dev-ready" ]; then return 0; fi
    log "installing ruby-dev and gcc in $dir (once)"
    chroot "$dir" apt-get -qq -o Acquire::Check-Valid-Until=false update >>"$CACHE/dev.log" 2>&1
    chroot "$dir" apt-get -qq -o Acquire::Check-Valid-Until=false install -y "$@" gcc make libc6-dev \
        >>"$CACHE/dev.log" 2>&1 || { tail -20 "$CACHE/dev.log" >&2; exit 1; }
    touch "$dir/.rprof-dev-ready"
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

# source_ruby NAME PACKAGE SUITE CONFIGURE-FLAGS...: builds Debian's source of
# PACKAGE (from SUITE) into $CACHE/ruby-NAME, once.
source_ruby() {
    name=$1 pkg=$2 suite=$3
    shift 3
    prefix="$CACHE/ruby-$name"
    if [ -x "$prefix/bin/ruby" ] && [ -f "$prefix/.rprof-ready" ]; then return 0; fi
    log "building ruby $name from Debian's $pkg source into $prefix (5 to 10 minutes, once)"
    if ! grep -qs "^Suites:.*$suite" /etc/apt/sources.list.d/rprof-src.sources; then
        cat >/etc/apt/sources.list.d/rprof-src.sources <<SRC
Types: deb-src
URIs: $MIRROR
Suites: bookworm trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
        apt-get update -qq
    fi
    apt-get install -y -qq dpkg-dev autoconf bison libssl-dev libyaml-dev libffi-dev libgmp-dev zlib1g-dev >/dev/null
    work="$CACHE/build-$name"
    rm -rf "$work" && mkdir -p "$work"
    (cd "$work" && apt-get source -qq --download-only "$pkg/$suite" >/dev/null 2>&1 && tar xf "${pkg}"_*.orig.tar.*) \
        || { echo "setup-rubies: could not fetch the source of $pkg from $suite" >&2; exit 1; }
    src=$(find "$work" -maxdepth 1 -type d -name 'ruby-*' | head -1)
    (cd "$src" && ./configure --prefix="$prefix" --disable-install-doc "$@" >"$work/configure.log" 2>&1 \
        && make -j"$(nproc)" >"$work/make.log" 2>&1 \
        && make install HAVE_BASERUBY=no >"$work/install.log" 2>&1) \
        || { tail -30 "$work"/*.log >&2; exit 1; }
    rm -rf "$work"
    touch "$prefix/.rprof-ready"
}

# The static ruby 3.1 links libruby into the executable (local-exec TLS).
static_ruby() { source_ruby 3.1-static ruby3.1 bookworm --disable-shared; }

# Ruby 3.3 as production images build it: a shared libruby, and YJIT (written
# in Rust: Debian's rustc builds it).
yjit_ruby() {
    apt-get install -y -qq rustc >/dev/null
    source_ruby 3.3-yjit ruby3.3 trixie --enable-shared --enable-yjit
    "$CACHE/ruby-3.3-yjit/bin/ruby" --yjit -e 'exit(RubyVM::YJIT.enabled? ? 0 : 1)' \
        || { echo "setup-rubies: the 3.3-yjit build has no working YJIT" >&2; exit 1; }
}

# Ruby 3.3 with frame pointers everywhere (Ubuntu 24.04+, Fedora 38+ build
# their packages so): the same source as Debian 13's, to compare stacks.
fp_ruby() {
    source_ruby 3.3-fp ruby3.3 trixie --enable-shared \
        optflags="-O2 -fno-omit-frame-pointer -mno-omit-leaf-frame-pointer"
}

host_ruby() {
    if command -v ruby >/dev/null && ruby -e 'exit(RUBY_VERSION.start_with?("3.1") ? 0 : 1)'; then return 0; fi
    apt-get install -y -qq ruby >/dev/null
}

server_chroot() {
    dir="$CACHE/chroot-server"
    if [ -f "$dir/.rprof-server-checked" ]; then return 0; fi
    chroot_ruby server bookworm ruby,man-db
    for absent in gcc cc libelf.so.1; do
        if chroot "$dir" sh -c "command -v $absent || ls /usr/lib/*/$absent" >/dev/null 2>&1; then
            echo "setup-rubies: the server chroot has $absent, which a production server need not" >&2
            exit 1
        fi
    done
    touch "$dir/.rprof-server-checked"
}

[ $# -eq 0 ] && set -- all
for what in "$@"; do
    case "$what" in
        host) host_ruby ;;
        2.7) chroot_ruby 2.7 bullseye; chroot_dev 2.7 ruby-dev ;;
        3.3) chroot_ruby 3.3 trixie; chroot_dev 3.3 ruby-dev ;;
        3.4) chroot_ruby34; chroot_dev 3.4 -t experimental ruby3.4-dev ;;
        static) static_ruby ;;
        3.3-yjit) yjit_ruby ;;
        3.3-fp) fp_ruby ;;
        server) server_chroot ;;
        all)
            host_ruby
            # The chroots wait mostly on the network and the disk, the builds
            # on the CPUs: side by side, the first set-up takes minutes less.
            (
                chroot_ruby 2.7 bullseye; chroot_dev 2.7 ruby-dev
                chroot_ruby 3.3 trixie; chroot_dev 3.3 ruby-dev
                chroot_ruby34; chroot_dev 3.4 -t experimental ruby3.4-dev
                server_chroot
            ) &
            chroots=$!
            static_ruby; yjit_ruby; fp_ruby
            wait "$chroots" || { echo "setup-rubies: a chroot could not be set up (above)" >&2; exit 1; } ;;
        *) echo "setup-rubies: unknown '$what' (host, 2.7, 3.3, 3.4, static, 3.3-yjit, 3.3-fp, server, all)" >&2; exit 2 ;;
    esac
done
