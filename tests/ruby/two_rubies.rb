# A Ruby that starts another program (ARGV: its command line) and works on,
# so that a recording following both profiles this one whatever becomes of
# the other. The other is killed when this one ends.
child = Process.spawn(*ARGV)
at_exit { Process.kill(:KILL, child) rescue nil }
Thread.new { Process.wait(child) }

def spin
  x = 0
  x += 1 while x < 1_000_000
end

$stdout.puts "ready"
$stdout.flush
loop { spin }
