# Two Ractors burning CPU in different methods, in parallel.
Warning[:experimental] = false if Warning.respond_to?(:[]=)

def ractor_alpha
  x = 0
  x += 1 while x >= 0 # HOT alpha
end

def ractor_beta
  y = 0
  y += 2 while y >= 0 # HOT beta
end

ractors = [Ractor.new { ractor_alpha }, Ractor.new { ractor_beta }]
$stdout.puts "ready"
$stdout.flush
ractors.each(&:take)
