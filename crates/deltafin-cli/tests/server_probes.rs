//! What probing `deltafin serve` from outside found (issue 46): megabyte prompts that never
//! tokenized, tokenizing that froze every endpoint, connections that held the server without
//! sending a request, and framing answered with the wrong status. Each test failed on 99652cd.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

mod common;

use common::fixture;
use common::server::{chat_body, request_to, Server};

/// A server whose log goes to a file the test reads afterwards.
fn start_logged(extra: &[&str]) -> (Server, tempfile::NamedTempFile) {
    let log = tempfile::NamedTempFile::new().unwrap();
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let child: Child = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .args(["serve", "--model"])
        .arg(fixture())
        .args(["--port", &port.to_string(), "--context", "512"])
        .args(extra)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap();
    let s = Server { child, port };
    let t0 = Instant::now();
    while !matches!(s.request("GET", "/health", None, &[]), Ok((200, _, _))) {
        assert!(t0.elapsed() < Duration::from_secs(30), "server did not become healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
    (s, log)
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
    std::thread::sleep(Duration::from_millis(300));
    let mut extra = connect(&s);
    let _ = extra.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    let got = read_all(extra);
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
