# Unicorn cluster for the tests: 2 workers on $PORT. Each master prints
# "ready master=PID" when it reads this file (also the new master a USR2
# re-exec starts); each worker prints "worker PID" once forked.
worker_processes 2
listen "127.0.0.1:#{ENV.fetch("PORT")}"
timeout 60
after_fork do |_server, _worker|
  $stdout.puts "worker #{Process.pid}"
  $stdout.flush
end
$stdout.puts "ready master=#{Process.pid}"
$stdout.flush
