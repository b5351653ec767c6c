# A Ruby thread burning CPU at a fixed stack depth, for bench/sample-cost:
# waits for "go" on stdin, spins for SECONDS at DEPTH frames (<main>, the
# recursion, the spinning method), prints "spun SECONDS" and exits.
DEPTH = Integer(ARGV.fetch(0, "30"))
SECONDS = Float(ARGV.fetch(1, "3"))

def descend(depth)
  depth <= 2 ? spin : descend(depth - 1)
end

def spin
  stop = Process.clock_gettime(Process::CLOCK_MONOTONIC) + SECONDS
  x = 0
  x += 1 while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop
  x
end

$stdout.puts "ready"
$stdout.flush
$stdin.gets
t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
descend(DEPTH)
$stdout.puts "spun #{Process.clock_gettime(Process::CLOCK_MONOTONIC) - t}"
$stdout.flush
