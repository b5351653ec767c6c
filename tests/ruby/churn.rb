# Code churn as long-running apps see it (code reloading, define_method-heavy
# libraries, template engines): each generation defines a method with
# class_eval, calls it a few dozen times, removes it and defines the next under
# a new name, compacting the heap now and then. Freed and moved code leaves its
# addresses to new code, which is what a profiler naming frames by address
# gets wrong.
#
# Generation N is compiled as file "gen_N.rb" starting at line N, so every
# frame tells which method it belongs to twice: by its name (Churn#churn_N,
# block (k levels) in Churn#churn_N) and by its file and line (gen_N.rb, lines
# N..N+7). The test checks that the two always agree, and that every frame has
# its line (the one-line block at N+4 is where a line is easiest to lose).
#
# ARGV: [work per call] [calls per generation] [generations between GC.compact]
# ["twin": a forked twin churns too, so that the target keeps both CPUs busy]
WORK = Integer(ARGV[0] || 3000)
CALLS = Integer(ARGV[1] || 30)
COMPACT_EVERY = Integer(ARGV[2] || 25)
TWIN = ARGV[3] == "twin"

class Churn
  def run
    gen = 0
    loop do
      gen += 1
      name = "churn_#{gen}"
      Churn.class_eval(<<~RUBY, "gen_#{gen}.rb", gen)
        def #{name}(n)
          [1].each do
            [2].each do
              x = 0; x += 1 while x < n
              acc = 0; (n / 2).times { |k| acc ^= k * n }; x + acc
            end
          end
        end
      RUBY
      CALLS.times { send(name, WORK) }
      Churn.send(:remove_method, name)
      GC.compact if (gen % COMPACT_EVERY).zero? && GC.respond_to?(:compact)
    end
  end
end

$stdout.puts "ready"
$stdout.flush
parent = Process.pid
if TWIN && fork.nil?
  # The twin ends with its parent (the test stops only the process it started).
  Thread.new { sleep 0.1 while Process.ppid == parent; exit! }
end
Churn.new.run
