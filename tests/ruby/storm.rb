# A fork storm: once it gets SIGUSR1, forks COUNT (ARGV[0]) short-lived
# children, PARALLEL (ARGV[1]) at a time; each burns 25 ms of CPU in
# Object#storm_child and exits. Prints "progress 100" once 100 have exited,
# then "children PID,PID,..." once all have, and exits at the next SIGUSR1
# (so that rprof is still recording when it is measured).
COUNT = Integer(ARGV.fetch(0))
PARALLEL = Integer(ARGV.fetch(1))

def storm_child
  deadline = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) + 0.025
  x = 0
  x += 1 while Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) < deadline
  x
end

$go = false
trap("USR1") { $go = true }
$stdout.puts "ready"
$stdout.flush
sleep 0.01 until $go
children = []
running = 0
exited = 0
COUNT.times do
  if running == PARALLEL
    Process.wait
    running -= 1
    exited += 1
    if exited == 100
      $stdout.puts "progress 100"
      $stdout.flush
    end
  end
  children << fork { storm_child; exit!(0) }
  running += 1
end
Process.waitall
$go = false
$stdout.puts "children #{children.join(",")}"
$stdout.flush
sleep 0.01 until $go
