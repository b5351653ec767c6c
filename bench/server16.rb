# A 16-thread server's CPU profile, as a long recording sees it: 16 threads
# handle "requests" (a mix of Ruby work, JSON, string building, sorting and
# short sleeps, ~40% busy), and every few seconds the app reloads code: a new
# method defined in a new file, the old one removed, GC.compact now and then.
# Prints "ready" and runs until killed.
require "json"

class App
  def handle(i)
    case i % 4
    when 0 then render(i)
    when 1 then JSON.generate({ id: i, items: (1..50).to_a, name: "x" * 20 })
    when 2 then (1..2000).map { |x| (x * 7919) % 1009 }.sort
    else compute(i)
    end
  end

  def render(i)
    out = +""
    200.times { |k| out << "<li>#{k}-#{i}</li>" }
    out
  end

  def compute(i)
    x = 0
    20_000.times { |k| x += k ^ i }
    x
  end
end

app = App.new
gen = 0
reloader = Thread.new do
  Thread.current.name = "reloader"
  loop do
    gen += 1
    App.class_eval("def reloaded_#{gen}(n); n.times.sum; end", "reloaded_#{gen}.rb", 1)
    app.send("reloaded_#{gen}", 10_000)
    App.send(:remove_method, "reloaded_#{gen - 1}") if gen > 1
    GC.compact if (gen % 20).zero? && GC.respond_to?(:compact)
    sleep 0.05
  end
end

workers = 16.times.map do |n|
  Thread.new do
    Thread.current.name = "worker-#{n}"
    i = 0
    loop do
      i += 1
      app.handle(i)
      sleep 0.004 if (i % 3).zero?
    end
  end
end

$stdout.puts "ready"
$stdout.flush
workers.each(&:join)
reloader.join
