# Burns CPU for SECONDS (ARGV[0]), then prints "burned CPU_SECONDS" (the CPU
# time it got meanwhile) and exits on its own. With ARGV[1] "on-usr1", it
# starts burning when it gets SIGUSR1 (so that rprof can be attached first).
def burn
  i = 0
  i += 1 while i < 10_000
end

go = ARGV[1] != "on-usr1"
trap("USR1") { go = true }
$stdout.puts "ready"
$stdout.flush
sleep 0.01 until go
cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + Float(ARGV.fetch(0))
burn while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
$stdout.puts "burned #{Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) - cpu}"
$stdout.flush
