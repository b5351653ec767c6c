# Started by rprof (`rprof record -- ruby launched.rb MODE`). Prints its user
# and groups and its nice value, then burns CPU in Object#burn, printing
# "tick" after every 0.2 s of CPU time; after three ticks MODE decides:
# "exit3" exits with status 3, "kill" kills itself with SIGKILL, "forever"
# burns until a signal.
def burn
  i = 0
  i += 1 while i < 10_000
end

def cpu
  Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
end

$stdout.puts "user uid=#{Process.uid} gid=#{Process.gid} home=#{ENV["HOME"]}"
$stdout.puts "nice #{Process.getpriority(Process::PRIO_PROCESS, 0)}"
ticks = 0
next_tick = cpu + 0.2
loop do
  burn
  next if cpu < next_tick
  next_tick += 0.2
  ticks += 1
  $stdout.puts "tick #{ticks}"
  $stdout.flush
  next if ticks < 3
  case ARGV[0]
  when "exit3" then exit 3
  when "kill" then Process.kill(:KILL, Process.pid)
  end
end
