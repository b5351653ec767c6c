# The syscall storm for bench/syscall-storm: waits for "go" on stdin, then
# calls getpid N times from a 30-frame deep Ruby stack, prints
# "made N elapsed SECONDS" and exits.
N = Integer(ARGV.fetch(0, "2000000"))

def dive(depth, &blk)
  depth.zero? ? blk.call : dive(depth - 1, &blk)
end

def storm
  i = 0
  while i < N
    Process.pid
    i += 1
  end
end

$stdout.puts "ready"
$stdout.flush
$stdin.gets
dive(25) do # <main>, 26 dive, the block, storm, Process.pid: 30 frames at getpid
  t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  storm
  $stdout.puts "made #{N} elapsed #{Process.clock_gettime(Process::CLOCK_MONOTONIC) - t}"
  $stdout.flush
end
