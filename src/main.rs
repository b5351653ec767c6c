//! rprof: parses the command line, runs it, prints errors. Nothing else.

mod bpf;
mod cli;
mod disasm;
mod elf;
mod error;
mod gc_time;
mod launch;
mod process;
mod processes;
mod record;
mod resolve;
mod system;
mod target;
mod unwind;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use clap::Parser;

use cli::{Cli, Command, Event, Format};
use record::{EventSpec, RecordConfig, Target};

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(err) => {
            // A problem the user can fix is one line; anything else gets its whole cause chain.
            match err.chain().find_map(|e| e.downcast_ref::<error::UserError>()) {
                Some(user) => eprintln!("rprof: error: {user}"),
                None => eprintln!("rprof: error: {err:#}"),
            }
            ExitCode::FAILURE
        }
    }
}

/// Runs the command; a launched command's exit status becomes rprof's.
fn run(cli: Cli) -> Result<ExitCode> {
    match cli.command {
        Command::Record(args) => {
            let (event, extra_command) = match args.event {
                None => (
                    EventSpec::Cpu {
                        frequency: args.frequency,
                    },
                    Vec::new(),
                ),
                Some(Event::Cpu { command }) => (
                    EventSpec::Cpu {
                        frequency: args.frequency,
                    },
                    command,
                ),
                Some(Event::Syscall { names, list, command }) => {
                    let known = system::syscall_tracepoints()?;
                    if list {
                        for name in known {
                            println!("{name}");
                        }
                        return Ok(ExitCode::SUCCESS);
                    }
                    let tracepoints = names
                        .iter()
                        .map(|n| system::syscall_tracepoint(n, &known))
                        .collect::<Result<Vec<_>, _>>()?;
                    (EventSpec::Syscalls(tracepoints), command)
                }
            };
            let mut command = args.command;
            command.extend(extra_command);
            let target = match (args.pid.is_empty(), command.is_empty()) {
                (false, true) => Target::Pids(args.pid),
                (true, false) => Target::Command(command),
                (false, false) => anyhow::bail!("give either -p PID or a command after --, not both"),
                (true, true) => anyhow::bail!(
                    "nothing to profile: give -p PID or a command after -- (see rprof record --help)"
                ),
            };
            let duration = match args.duration {
                Some(d) if !(d > 0.0 && d.is_finite()) => {
                    anyhow::bail!("-d/--duration must be a positive number of seconds")
                }
                Some(d) => Some(Duration::from_secs_f64(d)),
                None => None,
            };
            let status = record::record(RecordConfig {
                target,
                duration,
                event,
                output: args.output,
                format: args.format,
                force_version: args.force_version,
                as_root: args.root,
                subprocesses: args.subprocesses,
                processes: args.processes,
                threads: args.threads,
                native: args.native || args.native_all,
                native_all: args.native_all,
                kernel: args.kernel,
            })?;
            Ok(status.map_or(ExitCode::SUCCESS, |s| ExitCode::from(launch::exit_code(s))))
        }
        Command::Report(args) => {
            let recording = record::read_recording(&args.input)?;
            let output = args
                .output
                .unwrap_or_else(|| args.input.with_extension(args.format.extension()));
            if args.format == Format::Rprof && output == args.input {
                anyhow::bail!("refusing to overwrite {} with itself", args.input.display());
            }
            record::write_output(&recording, &output, args.format)?;
            eprintln!("rprof: wrote {}", output.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}
