# A Ruby process that does nothing, for bench/reader-cost: waits for "go" on
# stdin, sleeps SECONDS, prints "slept SECONDS" and exits. What rprof spends
# on it is the recording loop's own cost with no record to read.
SECONDS = Float(ARGV.fetch(0, "3"))

$stdout.puts "ready"
$stdout.flush
$stdin.gets
sleep SECONDS
$stdout.puts "slept #{SECONDS}"
$stdout.flush
