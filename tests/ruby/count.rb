# Waits for "go" on stdin, then calls getppid exactly N (ARGV[0]) times from
# a method chain, prints "done N" and exits. Ruby itself never calls getppid.
N = Integer(ARGV.fetch(0))

def call_ppid(n)
  i = 0
  while i < n
    Process.ppid
    i += 1
  end
end

$stdout.puts "ready"
$stdout.flush
$stdin.gets
call_ppid(N)
$stdout.puts "done #{N}"
$stdout.flush
