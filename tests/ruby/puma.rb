# Puma cluster for the tests: 2 workers with 2 threads each ($PUMA_THREADS
# if set), on $PORT. The master prints "ready" when it reads this file; each
# worker prints "worker PID" once booted (also when Puma forks a replacement).
workers 2
threads_per_worker = Integer(ENV.fetch("PUMA_THREADS", "2"))
threads threads_per_worker, threads_per_worker
bind "tcp://127.0.0.1:#{ENV.fetch("PORT")}"
worker_check_interval 1
on_worker_boot do
  $stdout.puts "worker #{Process.pid}"
  $stdout.flush
end
$stdout.puts "ready master=#{Process.pid}"
$stdout.flush
