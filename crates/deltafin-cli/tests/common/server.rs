//! A `deltafin serve` child over loopback and a minimal HTTP/1.1 client for the server tests.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::fixture;

pub struct Server {
    pub child: Child,
    pub port: u16,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start(extra: &[&str]) -> Server {
    start_env(extra, &[])
}

pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(["serve", "--model"])
        .arg(fixture())
        .args(if extra.contains(&"--context") { &[][..] } else { &["--context", "512"][..] })
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::null());
    let (child, port) = spawn_on_free_port(cmd, &log);
    let s = Server { child, port };
    let t0 = Instant::now();
    loop {
        if let Ok((200, _, _)) = s.request("GET", "/health", None, &[]) {
            return s;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "server did not become healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Starts a `serve` command on `--port 0` (unless it names a port) with its log in `log`, and
/// returns the child and the port the system gave it, read from the log's "listening on" line:
/// no port is picked in advance, so servers of tests running side by side can never share one.
pub fn spawn_on_free_port(mut cmd: Command, log: &tempfile::NamedTempFile) -> (Child, u16) {
    let given =
        cmd.get_args().position(|a| a == "--port").and_then(|i| cmd.get_args().nth(i + 1)).map(|p| p.to_string_lossy().into_owned());
    if given.is_none() {
        cmd.args(["--port", "0"]);
    }
    let mut child = cmd.env("NO_COLOR", "1").stderr(log.reopen().unwrap()).spawn().unwrap();
    if let Some(p) = given {
        return (child, p.parse().unwrap());
    }
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(log.path()).unwrap_or_default();
        if let Some(at) = text.find("listening on http://") {
            let rest = &text[at + "listening on http://".len()..];
            let addr = rest.split("/v1").next().unwrap_or("");
            if let Some(port) = addr.rsplit(':').next().and_then(|p| p.parse().ok()) {
                return (child, port);
            }
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("deltafin serve exited ({status}) before listening: {text}");
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "deltafin serve did not say where it listens: {text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl Server {
    /// A minimal HTTP/1.1 exchange: (status, headers, body).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        headers: &[(&str, &str)],
    ) -> std::io::Result<(u16, String, String)> {
        request_to(self.port, method, path, body, headers)
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, String, String) {
        self.request("POST", path, Some(body.to_string().as_bytes()), &[]).unwrap()
    }

    pub fn json(&self, path: &str, body: &Value) -> (u16, Value) {
        let (st, _, b) = self.post(path, body);
        (st, serde_json::from_str(&b).unwrap_or_else(|e| panic!("{e}: {b}")))
    }
}

/// A minimal HTTP/1.1 exchange with the server on `port`: (status, headers, body). Reads wait up
/// to 300 s: a request queued behind long ones on a loaded 2-core machine gets no byte before its turn.
pub fn request_to(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    headers: &[(&str, &str)],
) -> std::io::Result<(u16, String, String)> {
    {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(300)))?;
        let body = body.unwrap_or(b"");
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in headers {
            req += &format!("{k}: {v}\r\n");
        }
        req += "\r\n";
        s.write_all(req.as_bytes())?;
        s.write_all(body)?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
        Ok((status, head.to_string(), body))
    }
}

pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((len, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

pub fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

pub fn chat_body(text: &str, max: usize) -> Value {
    json!({"model": "k3", "messages": [{"role": "user", "content": text}], "max_tokens": max})
}
