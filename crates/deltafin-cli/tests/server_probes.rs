//! What probing `deltafin serve` from outside found (issue 46): megabyte prompts that never
//! tokenized, tokenizing that froze every endpoint, connections that held the server without
//! sending a request, and framing answered with the wrong status. Each test failed on 99652cd.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::fixture;
use common::server::{chat_body, request_to, spawn_on_free_port, Server};

/// A server whose log goes to a file the test reads afterwards.
fn start_logged(extra: &[&str]) -> (Server, tempfile::NamedTempFile) {
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(["serve", "--model"]).arg(fixture()).args(["--context", "512"]).args(extra).stdout(Stdio::null());
    (healthy(cmd, &log), log)
}

/// Starts `cmd` and waits until its server answers `/health`.
fn healthy(cmd: Command, log: &tempfile::NamedTempFile) -> Server {
    let (child, port) = spawn_on_free_port(cmd, log);
    let s = Server { child, port };
    let t0 = Instant::now();
    while !matches!(s.request("GET", "/health", None, &[]), Ok((200, _, _))) {
        assert!(t0.elapsed() < Duration::from_secs(60), "server did not become healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
    s
}

fn connect(s: &Server) -> TcpStream {
    let c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    c
}

/// Everything the server sends until it closes (or 30 s pass).
fn read_all(mut c: TcpStream) -> String {
    let mut raw = Vec::new();
    let _ = c.read_to_end(&mut raw);
    String::from_utf8_lossy(&raw).into_owned()
}

fn status_of(response: &str) -> u16 {
    response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[test]
fn megabyte_prompts_are_refused_and_health_answers_meanwhile() {
    let (s, _log) = start_logged(&[]);
    let port = s.port;
    let texts: Vec<(&str, Value)> = vec![
        ("chat", chat_body(&"a".repeat(1_000_000), 4)),
        ("chat", chat_body(&"é".repeat(1_000_000), 4)),
        ("chat", chat_body(&"ab".repeat(30_000), 4)),
        ("chat", chat_body(&"ab".repeat(30_000), 4)),
        ("completions", json!({"prompt": " ".repeat(30_001) + "x", "max_tokens": 4})),
        ("completions", json!({"prompt": "ab".repeat(1_000_000), "max_tokens": 4})),
    ];
    let senders: Vec<_> = texts
        .into_iter()
        .map(|(kind, body)| {
            std::thread::spawn(move || {
                let path = format!("/v1/{}", if kind == "chat" { "chat/completions" } else { "completions" });
                request_to(port, "POST", &path, Some(body.to_string().as_bytes()), &[]).unwrap()
            })
        })
        .collect();
    // /health while those are in flight: it must keep answering (it froze for 38 s before).
    let mut slowest = Duration::ZERO;
    for _ in 0..20 {
        let t0 = Instant::now();
        let (st, _, _) = s.request("GET", "/health", None, &[]).unwrap();
        assert_eq!(st, 200);
        slowest = slowest.max(t0.elapsed());
        std::thread::sleep(Duration::from_millis(20));
    }
    eprintln!("slowest /health while megabyte prompts were in flight: {slowest:?}");
    for t in senders {
        let (st, _, body) = t.join().unwrap();
        assert_eq!(st, 400, "{body}");
        assert!(body.contains("context limit of 512 tokens"), "{body}");
    }
    // And the server still generates.
    let (st, v) = s.json("/v1/chat/completions", &chat_body("Numbers matter here", 3));
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 3);
}

#[test]
fn a_half_sent_request_is_cut_off_and_does_not_block_shutdown() {
    let (s, _log) = start_logged(&["--header-timeout", "1"]);
    let mut half = connect(&s);
    half.write_all(b"POST /v1/chat/completions HTT").unwrap();
    let t0 = Instant::now();
    let got = read_all(half.try_clone().unwrap());
    assert!(t0.elapsed() < Duration::from_secs(20), "the connection was held {:?}", t0.elapsed());
    assert!(!got.starts_with("HTTP/1.1 200"), "{got}");
    // Another half-sent request, then SIGTERM: the server exits without waiting for it.
    let mut half = connect(&s);
    half.write_all(b"GET /heal").unwrap();
    let t0 = Instant::now();
    let pid = s.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let mut s = s;
    loop {
        if let Some(status) = s.child.try_wait().unwrap() {
            assert!(status.success(), "SIGTERM is a clean stop: {status}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(20), "shutdown waited on a half-sent request");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn connections_beyond_the_cap_get_503_and_the_server_recovers() {
    let (s, _log) = start_logged(&["--max-connections", "4", "--header-timeout", "30"]);
    let idle: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut c = connect(&s);
            c.write_all(b"GET /hea").unwrap();
            c
        })
        .collect();
    // Once the server has taken the four (a loaded machine may take a moment), a fifth is
    // turned away with a 503.
    let t0 = Instant::now();
    let got = loop {
        let mut extra = connect(&s);
        let _ = extra.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
        let got = read_all(extra);
        if status_of(&got) == 503 || t0.elapsed() > Duration::from_secs(10) {
            break got;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(status_of(&got), 503, "{got}");
    assert!(got.contains("too many open connections"), "{got}");
    drop(idle);
    let t0 = Instant::now();
    while !matches!(s.request("GET", "/health", None, &[]), Ok((200, _, _))) {
        assert!(t0.elapsed() < Duration::from_secs(10), "slots did not come back when the idle connections closed");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn framing_errors_get_the_right_status() {
    let (s, log) = start_logged(&["--max-body", "1M"]);
    // Expect: 100-continue with a declared body over the limit: 413 at once, no `100 Continue`.
    let mut c = connect(&s);
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n").unwrap();
    let got = read_all(c);
    assert_eq!(status_of(&got), 413, "{got}");
    assert!(!got.contains("100 Continue"), "{got}");
    // A malformed chunk size is a malformed request (400), not a large one.
    let mut c = connect(&s);
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\nzz\r\n{}\r\n0\r\n\r\n").unwrap();
    let got = read_all(c);
    assert_eq!(status_of(&got), 400, "{got}");
    // A client that goes away mid-body is not logged as a 413.
    let mut c = connect(&s);
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
        .unwrap();
    drop(c);
    // An unknown field whose name holds a line break cannot forge a log line.
    let forged = "x\nINFO request done id=forged status=200";
    let mut body = chat_body("hi", 2);
    body[forged] = json!(1);
    let (st, v) = s.json("/v1/chat/completions", &body);
    assert_eq!(st, 400);
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("unknown field") && !msg.contains('\n'), "{msg}");
    let long = "y".repeat(5000);
    let mut body = chat_body("hi", 2);
    body[&long] = json!(1);
    let (st, v) = s.json("/v1/chat/completions", &body);
    assert_eq!(st, 400);
    assert!(v["error"]["message"].as_str().unwrap().len() < 300, "an unknown name is echoed capped");
    std::thread::sleep(Duration::from_millis(300));
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert!(!text.lines().any(|l| l.starts_with("INFO request done id=forged")), "{text}");
    assert_eq!(text.matches("status=413").count(), 1, "one 413 (the oversized declared body), none for the reset: {text}");
}

/// A small deterministic generator (no dependency for it).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Text that has broken tokenizers and parsers: long runs, control characters, lone surrogate
/// escapes, control-token spellings, deep nesting, huge numbers.
fn pathological_text(rng: &mut Lcg) -> String {
    let pieces = [
        "a",
        "é",
        "ab",
        " ",
        "\n",
        "\r\n",
        "\t",
        "\u{0}",
        "\u{1b}[31m",
        "日本",
        "🙂",
        "<|open|>",
        "[EOS]",
        "\u{200b}",
        "\u{feff}",
        "'s",
        "1234567890",
        "\u{301}",
    ];
    let mut s = String::new();
    for _ in 0..1 + rng.below(6) {
        let p = pieces[rng.below(pieces.len())];
        let most = if rng.below(4) == 0 { 20_000 } else { 20 };
        s.push_str(&p.repeat(1 + rng.below(most)));
    }
    s
}

/// A request body: valid-looking JSON with odd values, or not JSON at all.
fn fuzz_body(rng: &mut Lcg) -> Vec<u8> {
    let text = pathological_text(rng);
    let v = match rng.below(9) {
        0 => json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2}),
        1 => json!({"prompt": text, "max_tokens": 2}),
        2 => json!({"messages": [{"role": "tool", "content": text, "tool_call_id": text}], "max_tokens": 1}),
        3 => json!({"messages": [{"role": text, "content": "x"}]}),
        4 => json!({"prompt": [rng.next(), -1, 1e300], "max_tokens": rng.next()}),
        5 => json!({"messages": [], "stop": [text], "max_tokens": 1}),
        6 => json!({text.clone(): 1, "prompt": "x"}),
        7 => {
            let mut deep = String::new();
            let n = 1 + rng.below(5000);
            deep.push_str(&"[".repeat(n));
            deep.push_str(&"]".repeat(n));
            return format!("{{\"prompt\": {deep}}}").into_bytes();
        }
        _ => return (0..rng.below(4000)).map(|_| rng.next() as u8).collect(),
    };
    v.to_string().into_bytes()
}

/// What one fuzz case sends: a body under honest, lying or broken framing, at once or slowly.
fn fuzz_request(rng: &mut Lcg) -> (Vec<u8>, bool) {
    let path = ["/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/%00", "/v1/../x"][rng.below(6)];
    let body = fuzz_body(rng);
    let mut head = format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n");
    let framed = match rng.below(8) {
        0 => {
            head += &format!("Content-Length: {}\r\n\r\n", body.len() + 1 + rng.below(100));
            [head.into_bytes(), body].concat()
        }
        1 => {
            head += "Transfer-Encoding: chunked\r\n\r\n";
            let mut b = head.into_bytes();
            b.extend(format!("{:x}\r\n", body.len() + rng.below(3)).as_bytes());
            b.extend(&body);
            b.extend(b"\r\n0\r\n\r\n");
            b
        }
        2 => {
            head += &format!("Content-Length: {}\r\nContent-Length: 3\r\n\r\n", body.len());
            [head.into_bytes(), body].concat()
        }
        3 => {
            head += &format!("X-Long: {}\r\nContent-Length: {}\r\n\r\n", "h".repeat(rng.below(200_000)), body.len());
            [head.into_bytes(), body].concat()
        }
        4 => (0..rng.below(300)).map(|_| rng.next() as u8).collect(),
        _ => {
            head += &format!("Content-Length: {}\r\n\r\n", body.len());
            [head.into_bytes(), body].concat()
        }
    };
    (framed, rng.below(25) == 0)
}

/// Random and pathological requests, framing and slow clients, each under a deadline: the server
/// answers every one with a status it documents (never a 5xx), or closes the connection, and
/// stays healthy.
#[test]
fn fuzzed_requests_get_documented_answers_and_the_server_stays_up() {
    let (mut s, log) = start_logged(&["--header-timeout", "2", "--body-timeout", "2"]);
    let mut rng = Lcg(46);
    let mut statuses = std::collections::BTreeMap::new();
    for case in 0..160 {
        let (bytes, slow) = fuzz_request(&mut rng);
        let mut c = connect(&s);
        c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let sent = if slow {
            // A slow client: a few bytes at a time.
            bytes.chunks(7).take(40).try_for_each(|b| {
                std::thread::sleep(Duration::from_millis(30));
                c.write_all(b)
            })
        } else {
            c.write_all(&bytes)
        };
        let _ = sent;
        let got = read_all(c);
        let status = status_of(&got);
        assert!(
            status == 0 || [200, 400, 401, 404, 405, 408, 413, 414, 429, 431, 503].contains(&status),
            "case {case}: status {status}: {}",
            got.chars().take(300).collect::<String>()
        );
        *statuses.entry(status).or_insert(0) += 1;
        assert!(s.child.try_wait().unwrap().is_none(), "case {case}: the server exited");
    }
    eprintln!("fuzzed statuses (0: connection closed without an answer): {statuses:?}");
    assert!(statuses.get(&400).copied().unwrap_or(0) > 10, "the fuzz reached the request parser: {statuses:?}");
    assert!(matches!(s.request("GET", "/health", None, &[]), Ok((200, _, _))));
    let text = std::fs::read_to_string(log.path()).unwrap();
    assert!(!text.contains("panicked"), "{text}");
}

/// The process's peak resident memory, from Linux's `/proc` (kB there).
#[cfg(target_os = "linux")]
fn peak_rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).expect("VmHWM").trim().trim_end_matches(" kB").trim();
    kb.parse::<u64>().unwrap() * 1024
}

/// Issue 46.8: 16 concurrent scoring requests of 2,800 tokens under an 80 MB budget held 118 MB
/// (glibc kept every freed step's blocks in its arenas). The budget governs what the engine
/// holds; the program's own code, stacks and request buffers come on top and must stay small.
#[cfg(target_os = "linux")]
#[test]
fn concurrent_scoring_stays_near_the_ram_budget() {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../training/models/k3");
    let home = tempfile::tempdir().unwrap();
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    cmd.args(["serve", "--model"])
        .arg(&model)
        .args(["--ram-budget", "80M", "--max-batch", "4", "--max-queue", "16"])
        .env("DELTAFIN_HOME", home.path())
        .stdout(Stdio::null());
    let s = healthy(cmd, &log);
    let words = ["the", "cat", "sat", "on", "a", "mat", "while", "dog", "ran", "far", "into", "woods"];
    let clients: Vec<_> = (0..16usize)
        .map(|i| {
            let text: Vec<&str> = (0..2800).map(|j| words[(j * 7 + i * 13 + j * j % 11) % words.len()]).collect();
            let body = json!({"model": "k3", "prompt": text.join(" "), "max_tokens": 0, "echo": true, "logprobs": 5});
            let port = s.port;
            std::thread::spawn(move || request_to(port, "POST", "/v1/completions", Some(body.to_string().as_bytes()), &[]).map(|r| r.0))
        })
        .collect();
    for c in clients {
        assert_eq!(c.join().unwrap().unwrap(), 200);
    }
    let peak = peak_rss_bytes(s.child.id());
    eprintln!("peak RSS {:.1} MB under an 80 MB budget", peak as f64 / 1e6);
    let log = std::fs::read_to_string(log.path()).unwrap();
    assert!(log.contains("prompt_tokens=28"), "the requests scored their prompts: {log}");
    // 80 MB of budget plus 12 MB for the program itself (its code and thread stacks: 7 MB measured).
    assert!(peak < 92_000_000, "peak RSS {:.1} MB under an 80 MB budget", peak as f64 / 1e6);
}
