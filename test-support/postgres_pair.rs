//! PostgreSQL servers of a test's own, made from the installed binaries on free loopback
//! ports: one primary, and a streaming standby made from it with `pg_basebackup -R`,
//! asynchronous or synchronous. Shared by the SQL store's failover and
//! synchronous-replication tests (`idempotency-store-sql/tests/failover.rs`,
//! `idempotency-store-sql/tests/synchronous_replication.rs`, each including this file with
//! `#[path]`).
//!
//! The binaries are found in the newest `/usr/lib/postgresql/*/bin`, or in
//! `IDEMPOTENCY_TEST_PG_BIN`. Without them the tests are skipped with a notice, except
//! under `CI=true`, where that is a failure. As root, the servers run as the `postgres`
//! user (PostgreSQL refuses root).
#![allow(dead_code)]

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path as FsPath, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub(crate) fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The directory of `initdb`, `pg_ctl`, `pg_basebackup`; `None` (skip) when missing,
/// a panic under `CI=true`.
pub(crate) fn postgres_bin() -> Option<PathBuf> {
    let found = std::env::var_os("IDEMPOTENCY_TEST_PG_BIN")
        .map(PathBuf::from)
        .or_else(|| {
            let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
                .ok()?
                .filter_map(|entry| Some(entry.ok()?.path().join("bin")))
                .filter(|bin| bin.join("initdb").exists())
                .collect();
            dirs.sort_by_key(|dir| {
                dir.parent()
                    .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
                    .unwrap_or(0)
            });
            dirs.pop()
        })
        .filter(|bin| bin.join("initdb").exists() && bin.join("pg_basebackup").exists());
    if found.is_none() {
        let message = "the PostgreSQL server binaries (initdb, pg_ctl, pg_basebackup) were not \
                       found in /usr/lib/postgresql/*/bin: install PostgreSQL (apt-get install \
                       postgresql) or point IDEMPOTENCY_TEST_PG_BIN at them";
        if in_ci() {
            panic!("{message} (CI=true: this is a failure, not a skip)");
        }
        eprintln!("SKIPPED: {message}");
    }
    found
}

pub(crate) fn as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// Runs a PostgreSQL program, as the `postgres` user when we are root.
pub(crate) fn pg(bin: &FsPath, program: &str, args: &[&str]) -> std::process::Output {
    let path = bin.join(program);
    let mut command = if as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(&path);
        command
    } else {
        Command::new(&path)
    };
    let output = command
        .args(args)
        .output()
        .unwrap_or_else(|error| panic!("run {program}: {error}"));
    assert!(
        output.status.success(),
        "{program} {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port")
}

/// One PostgreSQL cluster (data directory and server); killed on drop.
pub(crate) struct PgServer {
    bin: PathBuf,
    pub(crate) data: PathBuf,
    pub(crate) port: u16,
    killed: AtomicBool,
}

impl PgServer {
    /// The server's settings on the command line: loopback only, no Unix socket,
    /// replication on; `extra` adds `-c name=value` settings.
    pub(crate) fn start(&self, extra: &[&str]) {
        let mut options = format!(
            "-c listen_addresses=127.0.0.1 -c port={} -c unix_socket_directories='' \
             -c wal_level=replica -c max_wal_senders=5 -c max_connections=100 \
             -c fsync=off",
            self.port
        );
        for setting in extra {
            options.push_str(" -c ");
            options.push_str(setting);
        }
        let log = self.data.join("server.log");
        pg(
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "-o",
                &options,
                "start",
            ],
        );
    }

    pub(crate) fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// The postmaster's process id, from `postmaster.pid`.
    pub(crate) fn postmaster(&self) -> Option<u32> {
        std::fs::read_to_string(self.data.join("postmaster.pid"))
            .ok()?
            .lines()
            .next()?
            .trim()
            .parse()
            .ok()
    }

    /// SIGKILL to the postmaster and every process it started: nothing is flushed,
    /// nothing more is sent.
    pub(crate) fn kill(&self) {
        if self.killed.swap(true, Ordering::SeqCst) {
            return;
        }
        // Only a live postgres process: a stale postmaster.pid may name another one.
        let Some(postmaster) = self.postmaster().filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim() == "postgres")
        }) else {
            return;
        };
        let mut victims = children_of(postmaster);
        victims.push(postmaster);
        signal("KILL", &victims);
    }

    /// Promotes a standby and waits until it is a primary.
    pub(crate) fn promote(&self) {
        pg(
            &self.bin,
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "promote",
            ],
        );
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.data.join("server.log")).unwrap_or_default()
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "---- log of PostgreSQL on {} ----\n{}",
                self.port,
                self.log()
            );
        }
        self.kill();
    }
}

pub(crate) fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| {
            let pid: u32 = entry.ok()?.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            // pid (comm) state ppid …: the command may hold spaces, so read after ')'.
            let ppid: u32 = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            (ppid == parent).then_some(pid)
        })
        .collect()
}

pub(crate) fn signal(name: &str, pids: &[u32]) {
    if pids.is_empty() {
        return;
    }
    // A backend may exit between the listing and the signal: that is no error here.
    let _ = Command::new("kill")
        .arg(format!("-{name}"))
        .args(pids.iter().map(u32::to_string))
        .stderr(std::process::Stdio::null())
        .status();
}

/// A primary and a streaming standby made from it with `pg_basebackup -R`, in a
/// temporary directory.
pub(crate) struct Pair {
    pub(crate) primary: PgServer,
    pub(crate) standby: PgServer,
    _dir: tempfile::TempDir,
}

impl Pair {
    pub(crate) fn start(bin: &FsPath, synchronous: bool) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let primary_data = dir.path().join("primary");
        let standby_data = dir.path().join("standby");
        for data in [&primary_data, &standby_data] {
            std::fs::create_dir(data).unwrap();
            // PostgreSQL refuses a data directory others may read.
            std::fs::set_permissions(data, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        if as_root() {
            // The postgres user must reach and own the data directories.
            let status = Command::new("chmod")
                .arg("755")
                .arg(dir.path())
                .status()
                .unwrap();
            assert!(status.success());
            let status = Command::new("chown")
                .arg("postgres:")
                .arg(&primary_data)
                .arg(&standby_data)
                .status()
                .unwrap();
            assert!(status.success());
        }
        pg(
            bin,
            "initdb",
            &[
                "-D",
                primary_data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
                "--no-sync",
            ],
        );
        let primary = PgServer {
            bin: bin.to_owned(),
            data: primary_data,
            port: free_port(),
            killed: AtomicBool::new(false),
        };
        if synchronous {
            primary.start(&["synchronous_standby_names='*'", "synchronous_commit=on"]);
        } else {
            primary.start(&[]);
        }
        pg(
            bin,
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary.port.to_string(),
                "-U",
                "postgres",
                "-D",
                standby_data.to_str().unwrap(),
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
        );
        let standby = PgServer {
            bin: bin.to_owned(),
            data: standby_data,
            port: free_port(),
            killed: AtomicBool::new(false),
        };
        // The standby's own settings say nothing of synchronous standbys: once promoted
        // it has none, and would otherwise wait for ever on every commit.
        standby.start(&[]);
        Self {
            primary,
            standby,
            _dir: dir,
        }
    }
}

/// Waits until the primary streams to the standby (synchronously, if asked); answers
/// the WAL sender's process id.
pub(crate) async fn streaming(primary: &sqlx::PgPool, synchronous: bool) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let row: Option<(i32, String)> = sqlx::query_as(
            "SELECT pid, sync_state FROM pg_stat_replication WHERE state = 'streaming'",
        )
        .fetch_optional(primary)
        .await
        .unwrap();
        if let Some((pid, state)) = row
            && (!synchronous || state == "sync")
        {
            return pid as u32;
        }
        assert!(
            Instant::now() < deadline,
            "the standby did not stream within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
