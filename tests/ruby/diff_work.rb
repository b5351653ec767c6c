# Three methods with identical bodies: `first` and `second` once a round,
# `scaled` N times (the argument). A run with twice the N is a deploy that
# made one method twice as slow: 33/33/33% of the time with N = 1, 25/25/50%
# with N = 2. Each call counts to about a million (~30 ms), give or take
# 10% at random, so that no rhythm of calls lines up with the sampling.
def first(n)
  i = 0
  i += 1 while i < n
end

def second(n)
  i = 0
  i += 1 while i < n
end

def scaled(n)
  i = 0
  i += 1 while i < n
end

n = Integer(ARGV.fetch(0))
$stdout.puts "ready"
$stdout.flush
work = -> { rand(900_000..1_100_000) }
loop do
  first(work.call)
  second(work.call)
  n.times { scaled(work.call) }
end
