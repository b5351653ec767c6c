# Waits forever without using CPU.
$stdout.puts "ready"
$stdout.flush
sleep
