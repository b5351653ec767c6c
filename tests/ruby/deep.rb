# Recurses DEPTH levels (ARGV[0]) and spins at the bottom.
DEPTH = Integer(ARGV.fetch(0))

def spin
  x = 0
  while true
    x += 1
  end
end

def descend(n)
  if n.zero?
    $stdout.puts "ready depth=#{DEPTH}"
    $stdout.flush
    spin
  else
    descend(n - 1)
  end
end

descend(DEPTH)
