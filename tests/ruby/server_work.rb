# A short CPU-bound program for the install tests: about 2 seconds in
# Object#crunch's block (line 6), called from Object#serve, then it exits.

def crunch(n)
  x = 0
  n.times { |i| x += i * i }
  x
end

def serve
  started = Time.now
  crunch(100_000) while Time.now - started < 2
end

serve
