# Code that is all old (promoted by the collections before "ready") running
# beside young garbage: a minor GC every few ms, so nearly every CPU sample
# is a new record (its stack at a new GC time), and every record's code old.
# Runs until killed.
def piece(i)
  ("abc" * 20) + i.to_s
end

def work
  n = 0
  200.times { |i| n += piece(i).size }
  n
end

4.times { GC.start }
$stdout.puts "ready"
$stdout.flush
loop { work }
