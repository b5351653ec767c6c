# Short-lived forks for `rprof record --subprocesses ... alloc`: after a line
# on stdin, forks COUNT children one after another, GAP seconds apart. Each
# waits DELAY seconds (rprof probes a fork as it learns of it), makes 1,000
# Foo objects in `child_work`, lives on LINGER seconds (its frames are named
# from its memory) and exits: children end while later ones start. Prints
# "forked PID" as each is forked and "done" once all have ended, then sleeps.
COUNT, GAP, DELAY, LINGER = ARGV.fetch(0, "10").to_i, *ARGV.drop(1).map(&:to_f)
class Foo; end

def child_work
  i = 0
  while i < 1000
    Foo.new
    i += 1
  end
end

$stdout.puts "ready"
$stdout.flush
$stdin.gets
COUNT.times do
  pid = fork do
    sleep DELAY
    child_work
    sleep LINGER
    exit!(0)
  end
  $stdout.puts "forked #{pid}"
  $stdout.flush
  sleep GAP
end
Process.waitall
$stdout.puts "done"
$stdout.flush
sleep
