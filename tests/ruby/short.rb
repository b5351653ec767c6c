# Burns CPU for SECONDS (ARGV[0]), then exits on its own.
def burn
  i = 0
  i += 1 while i < 10_000
end

deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + Float(ARGV.fetch(0))
$stdout.puts "ready"
$stdout.flush
burn while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
