# Forks a child per method below once it gets SIGUSR1 (so that rprof can be
# attached first; at once with ARGV[1] "now"), waits for them and exits.
# MODE (ARGV[0]):
#   cpu:    each child burns CPU in its method for 0.8 s;
#   getpid: the child of method i (0, 1, 2) calls Process.pid 1000 * (i + 1) times.
# Prints "forked alpha=PID beta=PID gamma=PID" once all have been forked.
MODE = ARGV.fetch(0)

def job(n)
  if MODE == "cpu"
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + n
    i = 0
    i += 1 while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
  else
    n.times { Process.pid }
  end
end

def child_alpha(n)
  job(n)
end

def child_beta(n)
  job(n)
end

def child_gamma(n)
  job(n)
end

$go = ARGV[1] == "now"
trap("USR1") { $go = true }
$stdout.puts "ready"
$stdout.flush
sleep 0.01 until $go
pids = %w[alpha beta gamma].each_with_index.map do |name, i|
  n = MODE == "cpu" ? 0.8 : 1000 * (i + 1)
  pid = fork { send(:"child_#{name}", n) }
  "#{name}=#{pid}"
end
$stdout.puts "forked #{pids.join(" ")}"
$stdout.flush
Process.waitall
