# Two methods with identical bodies; one is called three times as often.
def thrice
  i = 0
  i += 1 while i < 1_000_000
end

def once
  i = 0
  i += 1 while i < 1_000_000
end

# Each call lasts tens of sampling periods: a 10 ms cycle of four calls at
# 999 Hz aliased (the samples fell on the same few points of every cycle,
# and thrice got 82.5% once).
$stdout.puts "ready"
$stdout.flush
loop do
  thrice
  thrice
  thrice
  once
end
