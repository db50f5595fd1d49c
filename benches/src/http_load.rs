//! Load over real HTTP on loopback: benchmark servers started as child processes, driven
//! by `wrk` (Debian package `wrk`) with a Lua script that gives each request its own key.

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::app;

/// The `wrk` script. Every request formats one unique `X-Request-Id` whatever the mode, so
/// the load generator does the same work for the bare server as for the layered ones:
///
/// - `nokey`: no `Idempotency-Key` (the layer passes the request through);
/// - `fresh`: a new key on every request (first executions);
/// - `fixed`: one key for the whole run, executed once beforehand (replays).
///
/// `done` prints one `RESULT` line that [`run_wrk`] parses.
pub const WRK_SCRIPT: &str = r#"
local mode, nonce, fixed = "nokey", "0", "k-fixed"
local counter = 0
local started = 0
local body = '{"item":"book","quantity":1}'

function setup(thread)
  started = started + 1
  thread:set("thread_id", started)
end

function init(args)
  mode = args[1] or mode
  nonce = args[2] or nonce
  fixed = args[3] or fixed
end

function request()
  counter = counter + 1
  local id = nonce .. "-" .. (thread_id or 0) .. "-" .. counter
  local headers = { ["Content-Type"] = "application/json", ["X-Request-Id"] = id }
  if mode == "fresh" then
    headers["Idempotency-Key"] = "k-" .. id
  elseif mode == "fixed" then
    headers["Idempotency-Key"] = fixed
  end
  return wrk.format("POST", "/orders", headers, body)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "RESULT requests=%d duration_us=%d p50_us=%.0f p99_us=%.0f non2xx=%d socket_errors=%d\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.status, e.connect + e.read + e.write + e.timeout))
end
"#;

/// A benchmark server running as a child process; killed when dropped.
#[derive(Debug)]
pub struct Server {
    /// A short name for tables.
    pub name: String,
    /// Where it listens.
    pub addr: SocketAddr,
    child: Child,
}

impl Server {
    /// Starts `program args…`, which must print `listening on ADDR` on its first line of
    /// standard output once it accepts connections.
    pub fn spawn(name: &str, program: &Path, args: &[&str]) -> Result<Self, String> {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", program.display()))?;
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok);
            let _ = tx.send(first);
            // Keep draining so that the server never blocks on a full pipe.
            for _ in lines {}
        });
        let line = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Some(line)) => line,
            Ok(None) | Err(_) => {
                let _ = child.kill();
                let status = child.wait().ok();
                return Err(format!("{name} did not start ({status:?})"));
            }
        };
        let addr = line
            .strip_prefix("listening on ")
            .and_then(|a| a.trim().parse().ok())
            .ok_or_else(|| format!("{name} printed {line:?} instead of its address"))?;
        Ok(Self {
            name: name.to_owned(),
            addr,
            child,
        })
    }

    /// The server process's id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The raw answer to one request: its status and its header block (lower-cased).
#[derive(Debug)]
pub struct RawResponse {
    /// The status code.
    pub status: u16,
    /// The header lines, lower-cased.
    pub headers: String,
}

/// Sends one `POST /orders` with the benchmark body (and `key`, if any) on a fresh
/// connection, the same bytes the load generator sends.
pub fn post_once(addr: SocketAddr, key: Option<&str>) -> Result<RawResponse, String> {
    let mut stream =
        TcpStream::connect(addr).map_err(|e| format!("cannot connect to {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .map_err(|e| e.to_string())?;
    let key_line = key
        .map(|k| format!("Idempotency-Key: {k}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "POST {} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         X-Request-Id: check\r\n{key_line}Content-Length: {}\r\nConnection: close\r\n\r\n{}",
        app::PATH,
        app::REQUEST_BODY.len(),
        app::REQUEST_BODY
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| e.to_string())?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&answer).to_ascii_lowercase();
    let (head, _) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("unreadable answer from {addr}: {head:?}"))?;
    Ok(RawResponse {
        status,
        headers: head.to_owned(),
    })
}

/// Checks that a layered server executes `key` (now or earlier) and then replays it.
pub fn check_replays(addr: SocketAddr, key: &str) -> Result<(), String> {
    let first = post_once(addr, Some(key))?;
    if first.status != 201 {
        return Err(format!("the first request got {}", first.status));
    }
    let second = post_once(addr, Some(key))?;
    if second.status != 201 || !second.headers.contains("idempotent-replayed: true") {
        return Err(format!(
            "the retry was not replayed: {} {:?}",
            second.status, second.headers
        ));
    }
    Ok(())
}

/// What one `wrk` run measured.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadResult {
    /// Completed requests.
    pub requests: u64,
    /// Requests per second.
    pub rps: f64,
    /// Median latency in microseconds.
    pub p50_us: f64,
    /// 99th-percentile latency in microseconds.
    pub p99_us: f64,
    /// Answers with a status of 400 or more.
    pub non_2xx: u64,
    /// Connect, read, write errors and time-outs.
    pub socket_errors: u64,
}

/// Load-generator settings for one run.
#[derive(Clone, Copy, Debug)]
pub struct Load<'a> {
    /// The `wrk` script on disk.
    pub script: &'a Path,
    /// Open connections.
    pub connections: usize,
    /// `wrk` threads.
    pub threads: usize,
    /// How long to run.
    pub seconds: u64,
}

/// Runs `wrk` against `addr` in `mode` (`nokey`, `fresh` or `fixed`).
pub fn run_wrk(
    load: Load<'_>,
    addr: SocketAddr,
    mode: &str,
    nonce: &str,
    fixed_key: &str,
) -> Result<LoadResult, String> {
    let threads = load.threads.clamp(1, load.connections.max(1));
    let output = Command::new("wrk")
        .arg(format!("-t{threads}"))
        .arg(format!("-c{}", load.connections))
        .arg(format!("-d{}s", load.seconds))
        .arg("--timeout")
        .arg("10s")
        .arg("-s")
        .arg(load.script)
        .arg(format!("http://{addr}{}", app::PATH))
        .arg("--")
        .args([mode, nonce, fixed_key])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run wrk (apt-get install -y wrk): {e}"))?;
    let result = ResultLine::of("wrk", &output)?;
    let field = |name: &str| result.field(name);
    let requests = field("requests");
    let seconds = field("duration_us") / 1e6;
    Ok(LoadResult {
        requests: requests as u64,
        rps: requests / seconds,
        p50_us: field("p50_us"),
        p99_us: field("p99_us"),
        non_2xx: field("non2xx") as u64,
        socket_errors: field("socket_errors") as u64,
    })
}

/// The `RESULT name=value …` line a load generator prints last (`wrk` through its Lua
/// script, `grpc-load`).
pub struct ResultLine(String);

impl ResultLine {
    /// Finds the line in what `tool` printed, or says what it printed instead.
    pub fn of(tool: &str, output: &std::process::Output) -> Result<Self, String> {
        let stdout = String::from_utf8_lossy(&output.stdout);
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("RESULT "))
            .map(|line| Self(line.to_owned()))
            .ok_or_else(|| {
                format!(
                    "{tool} printed no result: {stdout} {}",
                    String::from_utf8_lossy(&output.stderr)
                )
            })
    }

    /// The value of `name=…`, or NaN when it is missing or not a number.
    pub fn field(&self, name: &str) -> f64 {
        self.0
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    }
}
