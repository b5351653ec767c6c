# Burns CPU in Object#burn_NAME (NAME: ARGV[0]) for SECONDS (ARGV[1]).
NAME = ARGV.fetch(0)
Object.class_eval("def burn_#{NAME}; i = 0; i += 1 while i < 10_000; end", __FILE__, __LINE__)
deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + Float(ARGV.fetch(1))
$stdout.puts "ready"
$stdout.flush
send(:"burn_#{NAME}") while Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
