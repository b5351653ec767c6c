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
# N..N+3). The test checks that the two always agree.
#
# ARGV: [work per call] [calls per generation] [generations between GC.compact]
WORK = Integer(ARGV[0] || 3000)
CALLS = Integer(ARGV[1] || 30)
COMPACT_EVERY = Integer(ARGV[2] || 25)

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
              x = 0; x += 1 while x < n; x
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
Churn.new.run
