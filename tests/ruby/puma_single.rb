# Puma in single mode for the wall tests: one thread on $PORT. Prints
# "ready master=PID" when it reads this file.
threads 1, 1
bind "tcp://127.0.0.1:#{ENV.fetch("PORT")}"
$stdout.puts "ready master=#{Process.pid}"
$stdout.flush
