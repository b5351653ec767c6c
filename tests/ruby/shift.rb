# Burns CPU in `first_phase` until SIGUSR1, then in `second_phase`: the hot
# method changes when the test says so.
$switched = false
trap("USR1") { $switched = true }

def first_phase
  x = 0
  x += 1 until $switched
end

def second_phase
  x = 0
  x += 1 while x >= 0
end

$stdout.puts "ready"
$stdout.flush
first_phase
second_phase
