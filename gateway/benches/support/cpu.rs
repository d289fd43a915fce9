//! A process's CPU time, from `/proc/<pid>/stat` (user + system, every
//! thread): what it cost over a run, whatever else shared the cores.

use std::time::Duration;

/// User plus system CPU time `pid` has used so far.
pub fn used(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    // The command name (field 2) may hold spaces; fields after its ')'.
    let after = &stat[stat.rfind(')').expect("stat has a command name") + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 here.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_secs_f64(ticks as f64 / clock_ticks() as f64)
}

/// Clock ticks a second (`getconf CLK_TCK`).
fn clock_ticks() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100)
}

/// Time on a CPU of `pid`'s live threads, from the scheduler's exact
/// count (`/proc/<pid>/task/*/schedstat`, nanoseconds): a check of
/// [`used`], which a thread that exits in between would escape.
pub fn scheduled(pid: u32) -> Duration {
    let mut ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(s) = std::fs::read_to_string(task.path().join("schedstat")) {
            ns += s
                .split(' ')
                .next()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
        }
    }
    Duration::from_nanos(ns)
}
