# A Ruby thread deep in native code, for bench/native: waits for "go" on
# stdin, descends RUBY_DEPTH Ruby frames, then for SECONDS calls
# RprofNative.deep(NATIVE_DEPTH) (tests/ruby/native_ext, built in EXT_DIR):
# NATIVE_DEPTH C frames above a burning leaf. A negative SECONDS is a fixed
# amount of work instead (-SECONDS * 300 calls, about that many seconds).
# With a fifth argument "each", every Ruby level calls the next through
# Array#each (a C method yielding to a block), as deep block nesting does:
# the native stack then grows with the Ruby one. Prints "spun ELAPSED".
ext_dir = ARGV.fetch(0)
RUBY_DEPTH = Integer(ARGV.fetch(1, "30"))
NATIVE_DEPTH = Integer(ARGV.fetch(2, "20"))
SECONDS = Float(ARGV.fetch(3, "3"))
THROUGH_EACH = ARGV[4] == "each"
$LOAD_PATH.unshift(ext_dir)
require "rprof_native"

def descend(depth)
  return spin if depth <= 2
  return [depth].each { |d| descend(d - 1) } if THROUGH_EACH
  descend(depth - 1)
end

def spin
  if SECONDS < 0
    (-SECONDS * 300).to_i.times { RprofNative.deep(NATIVE_DEPTH, 2_000_000) }
    return
  end
  stop = Process.clock_gettime(Process::CLOCK_MONOTONIC) + SECONDS
  RprofNative.deep(NATIVE_DEPTH, 2_000_000) while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop
end

$stdout.puts "ready"
$stdout.flush
$stdin.gets
t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
descend(RUBY_DEPTH)
$stdout.puts "spun #{Process.clock_gettime(Process::CLOCK_MONOTONIC) - t}"
$stdout.flush
