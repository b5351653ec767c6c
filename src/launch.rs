//! The command rprof starts (`rprof record -- CMD`): run as the user who ran
//! sudo, stop signals passed on to it, and its exit status passed back, so
//! that rprof can stand in for the command in a script.

use std::ffi::CString;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::iterator::SignalsInfo;
use signal_hook::low_level::siginfo::Cause;

/// Starts `argv` with rprof's standard streams. Run as root through sudo,
/// the command runs as the user who ran sudo (`SUDO_UID`, `SUDO_GID`, their
/// groups and home), unless `as_root`: a program should not gain root because
/// it is being profiled.
pub fn spawn(argv: &[String], as_root: bool) -> Result<Child> {
    let (prog, args) = argv.split_first().context("no command given after --")?;
    let mut cmd = Command::new(prog);
    cmd.args(args);
    if let Some(user) = (!as_root).then(sudo_user).flatten() {
        cmd.env("HOME", &user.home)
            .env("USER", &user.name)
            .env("LOGNAME", &user.name);
        let SudoUser { uid, gid, groups, .. } = user;
        // SAFETY: between fork and exec the child makes only system calls
        // (setgroups, setgid, setuid: async-signal-safe), on data prepared
        // before the fork. Groups first: only root may set them.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setgid(gid) != 0
                    || libc::setuid(uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    cmd.spawn().with_context(|| format!("starting {prog}"))
}

/// The exit status a shell would give: the command's code, or 128 + the
/// signal that killed it.
pub fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code as u8,
        (None, Some(sig)) => 128u8.wrapping_add(sig as u8),
        (None, None) => 1,
    }
}

/// The user who ran `sudo rprof ...`, if rprof is root through sudo.
struct SudoUser {
    uid: u32,
    gid: u32,
    /// Supplementary groups, from the group database.
    groups: Vec<libc::gid_t>,
    name: String,
    home: String,
}

fn sudo_user() -> Option<SudoUser> {
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let uid: u32 = std::env::var("SUDO_UID").ok()?.parse().ok()?;
    let gid: u32 = std::env::var("SUDO_GID").ok()?.parse().ok()?;
    if uid == 0 {
        return None;
    }
    let (name, home) = passwd_entry(uid).unwrap_or_else(|| (uid.to_string(), "/".to_string()));
    let groups = group_list(&name, gid);
    Some(SudoUser {
        uid,
        gid,
        groups,
        name,
        home,
    })
}

/// The groups `name` belongs to, `gid` among them.
fn group_list(name: &str, gid: u32) -> Vec<libc::gid_t> {
    let Ok(cname) = CString::new(name) else {
        return vec![gid];
    };
    let mut groups = vec![0 as libc::gid_t; 256];
    let mut n = groups.len() as libc::c_int;
    // SAFETY: getgrouplist writes at most n entries into groups and sets n.
    let rc = unsafe { libc::getgrouplist(cname.as_ptr(), gid, groups.as_mut_ptr(), &mut n) };
    if rc < 0 {
        return vec![gid];
    }
    groups.truncate(n.max(0) as usize);
    groups
}

/// Name and home directory of `uid` from the user database.
fn passwd_entry(uid: u32) -> Option<(String, String)> {
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 4096];
    let mut result = std::ptr::null_mut();
    // SAFETY: getpwuid_r writes into pwd and buf, both ours and sized as given.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() {
        return None;
    }
    // SAFETY: on success both point to NUL-terminated strings inside buf.
    let text = |p: *const libc::c_char| {
        unsafe { std::ffi::CStr::from_ptr(p) }
            .to_string_lossy()
            .into_owned()
    };
    Some((text(pwd.pw_name), text(pwd.pw_dir)))
}

/// SIGINT, SIGTERM and SIGHUP stop the recording (what was collected is
/// written). A signal sent to rprof alone (`kill`) is passed on to the command
/// rprof started; one from the terminal (Ctrl-C) is not, as the terminal
/// sends it to the command too.
pub struct StopSignals {
    stop: Arc<AtomicBool>,
    command: Arc<AtomicU32>,
    /// SIGUSR2: write the flight recorder's window now.
    write_now: Arc<AtomicBool>,
}

impl StopSignals {
    pub fn install() -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let command = Arc::new(AtomicU32::new(0));
        let mut signals = SignalsInfo::<WithOrigin>::new([SIGINT, SIGTERM, SIGHUP])
            .context("installing signal handlers")?;
        {
            let (stop, command) = (Arc::clone(&stop), Arc::clone(&command));
            std::thread::spawn(move || {
                for origin in signals.forever() {
                    stop.store(true, Ordering::SeqCst);
                    let pid = command.load(Ordering::SeqCst);
                    let from_terminal = matches!(origin.cause, Cause::Kernel);
                    if pid != 0 && !from_terminal {
                        // SAFETY: kill only sends a signal.
                        unsafe { libc::kill(pid as libc::pid_t, origin.signal) };
                    }
                }
            });
        }
        let write_now = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGUSR2, Arc::clone(&write_now))
            .context("installing the SIGUSR2 handler")?;
        Ok(Self {
            stop,
            command,
            write_now,
        })
    }

    /// Whether SIGUSR2 came since the last call.
    pub fn take_write_request(&self) -> bool {
        self.write_now.swap(false, Ordering::SeqCst)
    }

    /// Signals from now on are passed on to `pid` too.
    pub fn forward_to(&self, pid: u32) {
        self.command.store(pid, Ordering::SeqCst);
    }

    pub fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}
