# Puma cluster for the tests: 2 workers with 2 threads each, on $PORT. The
# master prints "ready" when it reads this file; each worker prints
# "worker PID" once booted (also when Puma forks a replacement).
workers 2
threads 2, 2
bind "tcp://127.0.0.1:#{ENV.fetch("PORT")}"
worker_check_interval 1
on_worker_boot do
  $stdout.puts "worker #{Process.pid}"
  $stdout.flush
end
$stdout.puts "ready master=#{Process.pid}"
$stdout.flush
