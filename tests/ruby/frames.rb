# Frames rprof must name exactly as Ruby does, on every Ruby (2.7 syntax).
# A line ending in a HOT tag names the label that spends its time there.
# ARGV[0] picks what runs: lines, blocks, cfuncs, eval, callers, churn.

module Tools
  module Mixin
    def mixed(n)
      x = 0
      x += 1 while x < n # HOT Tools::Mixin#mixed
      x
    end
  end

  class Grinder
    include Mixin

    # The lines phase allocates nothing but spin_match's MatchData: a method
    # that allocates spends time off its hot line, in the allocation and the
    # GCs it brings. Under the test suite's load a `new` at build's last line
    # took 1-6% of build's samples on every Ruby, against the 5% the test
    # lets a hot line leave.
    ONE = [1].freeze
    TWO = [2].freeze
    WORD = "grind".freeze

    def self.build(n)
      x = 0
      x += 1 while x < n # HOT Tools::Grinder.build
      x
    end

    def spin(n)
      ONE.each do
        x = 0
        x += 1 while x < n # HOT block in Tools::Grinder#spin
      end
    end

    # One-line blocks whose frame is the leaf: much of their time is spent
    # before their first instruction runs (the pc at the iseq's start).
    def spin_inject(n)
      (0...n).inject(0) { |acc, x| acc + (x * 3) } # HOT(blocks) block in Tools::Grinder#spin_inject
    end

    def spin_each(n)
      acc = 0
      (0...n).each { |x| acc += x * 3 } # HOT(blocks) block in Tools::Grinder#spin_each
      acc
    end

    def spin_times(n)
      acc = 0
      n.times { |k| acc ^= k * n } # HOT(blocks) block in Tools::Grinder#spin_times
      acc
    end

    # A method that has set $~ (a regexp match) keeps it in an svar, which
    # takes its method entry's place in its frame: still Grinder's method.
    # The match shares the loop's line: a cold path after a long loop takes
    # 1-300 us here (a match 2.2 us median, 134 us p90 after 7.5 ms of
    # loop, against 0.3 us in a loop of matches), 2.0% of the method's
    # samples idle and 5.6% in a CI run (ci87) on a line of its own.
    def spin_match(n)
      x = (WORD =~ /in/) - 2; x += 1 while x < n # HOT Tools::Grinder#spin_match
      x
    end

    def deep_block(n)
      ONE.each do
        TWO.each do
          x = 0
          x += 1 while x < n # HOT block (2 levels) in Tools::Grinder#deep_block
        end
      end
    end
  end
end

class << Tools::Grinder
  def helper(n)
    x = 0
    x += 1 while x < n # HOT Tools::Grinder.helper
    x
  end
end

def toplevel(n)
  x = 0
  x += 1 while x < n # HOT Object#toplevel
  x
end

def lines
  n = 20_000
  g = Tools::Grinder.new
  loop do
    Tools::Grinder.build(n)
    g.spin(n)
    g.deep_block(n)
    g.spin_match(n * 6)
    g.mixed(n)
    Tools::Grinder.helper(n)
    toplevel(n)
  end
end

def blocks
  g = Tools::Grinder.new
  loop do
    g.spin_inject(300_000)
    g.spin_each(300_000)
    g.spin_times(300_000)
  end
end

def cfuncs
  # IO#write must hold a share of the time, or a recording may miss it: a
  # write to /dev/null costs nothing, and many small writes allocate enough
  # to run the GC hundreds of times a second. So: 2 MB rewritten in place in
  # a file unlinked at once (about 50 us of copying).
  out = File.open("/tmp/rprof-frames-#{$$}", "w")
  File.unlink(out.path)
  arr = (1..3000).to_a.reverse
  chunk = "x" * 2_000_000
  loop do
    3.times { arr.sort }
    out.rewind
    out.write(chunk)
  end
end

# What the starved test records: C methods, and young garbage that only
# minor GCs collect (a few hundred a second). `cfuncs` mallocs (Array#sort
# copies the array), which ran a major GC every 0.3 s on Ruby 2.7 (0.75 s on
# 3.3): a reading after a major GC cannot name what the sample saw before it.
def minor_gcs
  arr = (1..3000).to_a.reverse
  n = 0
  loop do
    3.times { n += arr.sum }
    20.times { |k| [k, k] }
  end
end

def eval_loop
  eval("x = 0\nx += 1 while true\n")
end

def level3
  # What Ruby itself says the stack is here; rprof must agree on the callers.
  caller_locations(0).each do |loc|
    $stdout.puts "frame #{loc.path}|#{loc.lineno}|#{loc.label}"
  end
  $stdout.puts "ready"
  $stdout.flush
  x = 0
  x += 1 while true # HOT level3
end

def level2
  [1].each { level3 }
end

def level1
  level2
end

# Defines, runs and drops methods while compacting the heap: iseqs come and go.
def churn
  i = 0
  loop do
    i += 1
    eval("def tmp_#{i % 50}(n); x = 0; x += 1 while x < n; x; end; tmp_#{i % 50}(20_000)")
    toplevel(20_000)
    GC.compact if (i % 200).zero? && GC.respond_to?(:compact)
  end
end

case ARGV.fetch(0)
when "callers"
  level1
else
  # cfuncs, minor_gcs (what the starved test records): the program's code
  # is long-lived by "ready", as in an app that has run a while; three GCs
  # promote it to the old generation, which rprof names however late it
  # reads, as long as no major GC comes between. lines: the GCs of a young
  # heap (major ones among them) come before "ready", not on a hot line's
  # allocation while the test records.
  3.times { GC.start } if %w[cfuncs minor_gcs lines].include?(ARGV[0])
  $stdout.puts "ready"
  $stdout.flush
  case ARGV[0]
  when "lines" then lines
  when "blocks" then blocks
  when "cfuncs" then cfuncs
  when "minor_gcs" then minor_gcs
  when "eval" then eval_loop
  when "churn" then churn
  else abort "unknown phase #{ARGV[0]}"
  end
end
