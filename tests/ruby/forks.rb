# Forks a child per method below once it gets SIGUSR1 (so that rprof can be
# attached first; at once with ARGV[1] "now"), waits for them and exits.
# MODE (ARGV[0]):
#   cpu:    each child burns CPU in its method for 0.8 s, then prints
#           "burned NAME=SECONDS", the CPU time it got meanwhile;
#   getpid: the child of method i (0, 1, 2) calls Process.pid 1000 * (i + 1) times;
#   reuse:  as cpu, but alpha is waited for first and beta forked on alpha's
#           PID (root sets /proc/sys/kernel/ns_last_pid just before the fork).
# Prints "forked alpha=PID beta=PID gamma=PID" once all have been forked.
MODE = ARGV.fetch(0)

def job(n, name)
  if MODE != "getpid"
    cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + n
    i = 0
    i += 1 while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
    cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) - cpu
    $stdout.puts "burned #{name}=#{cpu}"
    $stdout.flush
  else
    n.times { Process.pid }
  end
end

def child_alpha(n)
  job(n, "alpha")
end

def child_beta(n)
  job(n, "beta")
end

def child_gamma(n)
  job(n, "gamma")
end

$go = ARGV[1] == "now"
trap("USR1") { $go = true }
$stdout.puts "ready"
$stdout.flush
sleep 0.01 until $go
# Forks the child of `name` (on PID `on`, if given: tries until the kernel
# hands it out; the children of failed tries exit at once).
def child(name, n, on = nil)
  100.times do
    File.write("/proc/sys/kernel/ns_last_pid", (on - 1).to_s) if on
    pid = fork { send(:"child_#{name}", n) if on.nil? || Process.pid == on }
    return pid if on.nil? || pid == on
    Process.wait(pid)
  end
  abort "could not fork #{name} on PID #{on}"
end

pids = {}
%w[alpha beta gamma].each_with_index do |name, i|
  n = MODE == "getpid" ? 1000 * (i + 1) : 0.8
  on = pids["alpha"] if MODE == "reuse" && name == "beta"
  Process.wait(pids["alpha"]) if on
  pids[name] = child(name, n, on)
end
pids = pids.map { |name, pid| "#{name}=#{pid}" }
$stdout.puts "forked #{pids.join(" ")}"
$stdout.flush
Process.waitall
