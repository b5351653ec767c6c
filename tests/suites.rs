//! rprof's integration tests: one module per suite (tests/SUITE.rs), all in
//! one binary, which builds and links once instead of once per suite.
//! `scripts/run-tests.sh` runs each module as a suite of its own.

mod agent;
mod alloc;
mod browser;
mod common;
mod cpu;
mod diff;
mod errors;
mod frames;
mod gc;
mod install;
mod launch;
mod layouts;
mod native;
mod processes;
mod recordings;
mod servers;
mod syscall;
mod top;
mod wall;
