# Two methods with identical bodies; one is called three times as often.
def thrice
  i = 0
  i += 1 while i < 1_000_000
end

def once
  i = 0
  i += 1 while i < 1_000_000
end

def cpu_ns
  Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID, :nanosecond)
end

# The truth a profile is checked against: the CPU time each method took, as
# "spent thrice=NS once=NS" (totals so far) after each SIGUSR1. Each call
# lasts tens of sampling periods, so that no cycle of calls can line up with
# the sampling.
spent_thrice = 0
spent_once = 0
asked = false
trap("USR1") { asked = true }
$stdout.puts "ready"
$stdout.flush
loop do
  3.times do
    t = cpu_ns
    thrice
    spent_thrice += cpu_ns - t
  end
  t = cpu_ns
  once
  spent_once += cpu_ns - t
  next unless asked

  asked = false
  $stdout.puts "spent thrice=#{spent_thrice} once=#{spent_once}"
  $stdout.flush
end
