# Two methods with identical bodies; one is called three times as often.
def thrice
  i = 0
  i += 1 while i < 100_000
end

def once
  i = 0
  i += 1 while i < 100_000
end

$stdout.puts "ready"
$stdout.flush
loop do
  thrice
  thrice
  thrice
  once
end
