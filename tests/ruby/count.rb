# Waits for "go" on stdin, then calls getppid exactly N (ARGV[0]) times,
# prints "done N" and exits. Ruby itself never calls getppid.
#
# With SITES (ARGV[1]) above 1, the calls come from SITES methods site_0 ...
# site_{SITES-1}, each its own code and so its own stack, taking turns one
# call at a time; each makes N / SITES calls (N must be a multiple).
N = Integer(ARGV.fetch(0))
SITES = Integer(ARGV.fetch(1, "1"))
abort "N must be a multiple of SITES" unless (N % SITES).zero?

def call_ppid(n)
  i = 0
  while i < n
    Process.ppid
    i += 1
  end
end

# Methods from source text: each its own instruction sequence (methods made
# with define_method from one block would share one).
SITES.times do |k|
  Object.class_eval(<<~RUBY, "sites.rb", 10 * k + 1)
    def site_#{k}
      Process.ppid
    end
  RUBY
end
Object.class_eval(<<~RUBY, "rounds.rb", 1)
  def rounds(n)
    r = 0
    while r < n
      #{(0...SITES).map { |k| "site_#{k}" }.join("; ")}
      r += 1
    end
  end
RUBY

$stdout.puts "ready"
$stdout.flush
$stdin.gets
if SITES == 1
  call_ppid(N)
else
  rounds(N / SITES)
end
$stdout.puts "done #{N}"
$stdout.flush
