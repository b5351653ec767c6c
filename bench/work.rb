# A fixed amount of Ruby work for bench/overhead: waits for "go" on stdin,
# runs, prints "elapsed SECONDS" (measured inside Ruby) and exits.
class Grinder
  def initialize(n)
    @n = n
  end

  def run
    total = 0
    @n.times do |i|
      total += fib(18) + words(i).size
    end
    total
  end

  def fib(n)
    n < 2 ? n : fib(n - 1) + fib(n - 2)
  end

  def words(i)
    %w[alpha beta gamma delta].map { |w| "#{w}-#{i}" }.sort.join(",")
  end
end

n = Integer(ARGV.fetch(0, "3000"))
$stdout.puts "ready"
$stdout.flush
$stdin.gets
t = Process.clock_gettime(Process::CLOCK_MONOTONIC)
Grinder.new(n).run
$stdout.puts "elapsed #{Process.clock_gettime(Process::CLOCK_MONOTONIC) - t}"
$stdout.flush
