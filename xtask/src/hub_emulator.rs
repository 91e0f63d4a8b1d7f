//! A loopback hub for stream-install tests and benchmarks: serves a checkpoint folder in the Hugging
//! Face URL layout (`/api/models/R/revision/REV`, `/api/models/R/tree/COMMIT`, `/R/resolve/COMMIT/FILE`
//! redirecting to a "CDN" URL that serves byte ranges), with faults injected on demand: a body
//! dropped halfway, a wrong `Content-Range`, `200` instead of `206`, `503`, `429` with
//! `Retry-After`, a stalled body, a file whose bytes do not match its published SHA-256, and a rate
//! limit per connection. std threads only: one thread per connection, keep-alive honoured.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha1::Digest as _;

/// The commit every revision resolves to.
pub const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// Faults to inject into the next range responses (each counter is used up one response at a
/// time) and standing conditions.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    pub drop_mid_body: u32,
    pub wrong_content_range: u32,
    pub full_200: u32,
    pub server_error: u32,
    pub too_many_requests: u32,
    pub stall: u32,
    /// How long a stalled body hangs before the server closes it.
    pub stall_for: Duration,
    /// Files served with the byte at this offset flipped (their published SHA-256 is of the
    /// true bytes).
    pub corrupt: HashMap<String, u64>,
    /// Files whose 16 bytes from this offset are served flipped in the next N responses that
    /// cover them (corruption in transit: the bytes are right again afterwards).
    pub corrupt_once: HashMap<String, (u64, u32)>,
    /// Answer every range request with `200` and the whole file, as RFC 9110 allows a server
    /// that does not do ranges.
    pub ignore_range: bool,
    /// Bytes per second per connection (0: unlimited): the hub throttles each connection.
    pub rate: u64,
    /// Bytes per second over all connections together (0: unlimited): the user's link. Time
    /// with nothing sent is lost, as on a real link.
    pub link_rate: u64,
    /// Refuse (403) signed URLs older than this many uses, forcing a new `resolve`.
    pub signed_uses: Option<u64>,
}

/// Counters of what was served.
#[derive(Debug, Default)]
pub struct HubStats {
    pub range_requests: AtomicU64,
    pub resolves: AtomicU64,
    pub bytes: AtomicU64,
    pub connections: AtomicU64,
}

struct Shared {
    root: PathBuf,
    repo: String,
    files: HashMap<String, (u64, String, String)>,
    faults: Mutex<Faults>,
    stats: HubStats,
    signed: Mutex<HashMap<String, u64>>,
    stop: AtomicBool,
    /// When the link is next free (see [`Faults::link_rate`]).
    link_free: Mutex<Instant>,
}

/// A running loopback hub (stopped on drop).
pub struct HubEmulator {
    pub endpoint: String,
    shared: Arc<Shared>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl HubEmulator {
    /// Serves the files of `root` as repository `repo` (`OWNER/NAME`) on a free loopback port.
    pub fn start(root: &Path, repo: &str) -> std::io::Result<HubEmulator> {
        let mut files = HashMap::new();
        for e in std::fs::read_dir(root)? {
            let e = e?;
            if !e.file_type()?.is_file() {
                continue;
            }
            let bytes = std::fs::read(e.path())?;
            let sha256 = hex(&sha2::Sha256::digest(&bytes));
            let mut g = sha1::Sha1::new();
            g.update(format!("blob {}\0", bytes.len()).as_bytes());
            g.update(&bytes);
            files.insert(e.file_name().to_string_lossy().into_owned(), (bytes.len() as u64, sha256, hex(&g.finalize())));
        }
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let shared = Arc::new(Shared {
            root: root.to_path_buf(),
            repo: repo.into(),
            files,
            faults: Mutex::new(Faults { stall_for: Duration::from_secs(5), ..Faults::default() }),
            stats: HubStats::default(),
            signed: Mutex::new(HashMap::new()),
            stop: AtomicBool::new(false),
            link_free: Mutex::new(Instant::now()),
        });
        let s = shared.clone();
        listener.set_nonblocking(true)?;
        std::thread::spawn(move || {
            while !s.stop.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((c, _)) => {
                        let _ = c.set_nonblocking(false);
                        s.stats.connections.fetch_add(1, Ordering::Relaxed);
                        let s = s.clone();
                        std::thread::spawn(move || serve_connection(&s, c));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(HubEmulator { endpoint, shared })
    }

    /// Changes the faults.
    pub fn faults(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.shared.faults.lock().expect("poisoned"));
    }

    /// What was served so far.
    pub fn stats(&self) -> &HubStats {
        &self.shared.stats
    }
}

impl Drop for HubEmulator {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

struct Request {
    method: String,
    path: String,
    range: Option<(u64, u64)>,
}

fn read_request(r: &mut BufReader<TcpStream>) -> Option<Request> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next()?.to_string(), parts.next()?.to_string());
    let mut range = None;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).ok()? == 0 {
            return None;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("range") {
                let v = v.trim().strip_prefix("bytes=")?;
                let (a, b) = v.split_once('-')?;
                range = Some((a.parse().ok()?, b.parse().ok()?));
            }
        }
    }
    Some(Request { method, path, range })
}

fn respond(c: &mut TcpStream, status: &str, headers: &[(&str, String)], body: &[u8]) -> std::io::Result<()> {
    let mut head = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        head += &format!("{k}: {v}\r\n");
    }
    head += "\r\n";
    c.write_all(head.as_bytes())?;
    c.write_all(body)
}

fn serve_connection(s: &Shared, c: TcpStream) {
    let mut w = match c.try_clone() {
        Ok(w) => w,
        Err(_) => return,
    };
    let mut r = BufReader::new(c);
    while let Some(req) = read_request(&mut r) {
        if req.method != "GET" || !matches!(handle(s, &mut w, &req), Ok(true)) {
            return;
        }
    }
}

/// Answers one request; `Ok(false)` closes the connection.
fn handle(s: &Shared, c: &mut TcpStream, req: &Request) -> std::io::Result<bool> {
    let (path, _query) = req.path.split_once('?').unwrap_or((&req.path, ""));
    let api = format!("/api/models/{}/", s.repo);
    if let Some(rest) = path.strip_prefix(&api) {
        if rest.starts_with("revision/") {
            respond(c, "200 OK", &[], format!("{{\"sha\": \"{COMMIT}\"}}").as_bytes())?;
        } else if rest == format!("tree/{COMMIT}") {
            let mut items = Vec::new();
            let mut names: Vec<&String> = s.files.keys().collect();
            names.sort();
            for n in names {
                let (size, sha256, oid) = &s.files[n];
                if n.ends_with(".safetensors") {
                    items.push(serde_json::json!({"type": "file", "path": n, "size": size, "oid": oid, "lfs": {"oid": sha256, "size": size, "pointerSize": 134}}));
                } else {
                    items.push(serde_json::json!({"type": "file", "path": n, "size": size, "oid": oid}));
                }
            }
            respond(c, "200 OK", &[], serde_json::Value::Array(items).to_string().as_bytes())?;
        } else {
            respond(c, "404 Not Found", &[], b"{}")?;
        }
        return Ok(true);
    }
    let resolve = format!("/{}/resolve/{COMMIT}/", s.repo);
    if let Some(file) = path.strip_prefix(&resolve) {
        s.stats.resolves.fetch_add(1, Ordering::Relaxed);
        if !s.files.contains_key(file) {
            respond(c, "404 Not Found", &[], b"")?;
            return Ok(true);
        }
        let sig = format!("{}", s.stats.resolves.load(Ordering::Relaxed));
        s.signed.lock().expect("poisoned").insert(sig.clone(), 0);
        respond(c, "302 Found", &[("Location", format!("/cdn/{file}?sig={sig}"))], b"")?;
        return Ok(true);
    }
    let Some(file) = path.strip_prefix("/cdn/") else {
        respond(c, "404 Not Found", &[], b"")?;
        return Ok(true);
    };
    let faults = s.faults.lock().expect("poisoned").clone();
    if let Some(limit) = faults.signed_uses {
        let sig = req.path.split("sig=").nth(1).unwrap_or("").to_string();
        let mut signed = s.signed.lock().expect("poisoned");
        let uses = signed.entry(sig).or_insert(u64::MAX - 1);
        *uses = uses.saturating_add(1);
        if *uses > limit {
            drop(signed);
            respond(c, "403 Forbidden", &[], b"expired")?;
            return Ok(true);
        }
    }
    let Some(&(size, _, _)) = s.files.get(file) else {
        respond(c, "404 Not Found", &[], b"")?;
        return Ok(true);
    };
    let Some((a, b)) = req.range.filter(|&(a, b)| a <= b && b < size) else {
        respond(c, "400 Bad Request", &[], b"range requests only")?;
        return Ok(true);
    };
    s.stats.range_requests.fetch_add(1, Ordering::Relaxed);
    let take = |f: &mut dyn FnMut(&mut Faults) -> &mut u32| -> bool {
        let mut g = s.faults.lock().expect("poisoned");
        let n = f(&mut g);
        if *n > 0 {
            *n -= 1;
            true
        } else {
            false
        }
    };
    if take(&mut |f| &mut f.server_error) {
        respond(c, "503 Service Unavailable", &[], b"")?;
        return Ok(true);
    }
    if take(&mut |f| &mut f.too_many_requests) {
        respond(c, "429 Too Many Requests", &[("Retry-After", "1".into())], b"")?;
        return Ok(true);
    }
    let f = std::fs::File::open(s.root.join(file))?;
    let corrupt_at = faults.corrupt.get(file).copied();
    // A transient corruption applies to this response if it covers the bytes, and is used up.
    let flip_once = {
        let mut g = s.faults.lock().expect("poisoned");
        match g.corrupt_once.get_mut(file) {
            Some((at, n)) if *n > 0 && (a..=b).contains(at) => {
                *n -= 1;
                Some(*at)
            }
            _ => None,
        }
    };
    // Bytes `from..from + len` of the file as served (a planted corrupt byte flipped). Read as
    // they are sent, like a CDN streaming from its store: reading a whole 64 MiB range before
    // the first byte would idle the link between requests, which no real hub does.
    let read = |from: u64, len: usize| -> std::io::Result<Vec<u8>> {
        let mut bytes = vec![0u8; len];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut bytes, from)?;
        if let Some(at) = corrupt_at.filter(|&at| (from..from + len as u64).contains(&at)) {
            bytes[(at - from) as usize] ^= 0x10;
        }
        if let Some(at) = flip_once {
            for i in at..at + 16 {
                if (from..from + len as u64).contains(&i) {
                    bytes[(i - from) as usize] ^= 0x5a;
                }
            }
        }
        Ok(bytes)
    };
    let total = (b - a + 1) as usize;
    if faults.ignore_range || take(&mut |f| &mut f.full_200) {
        respond(c, "200 OK", &[], &read(0, size as usize)?)?;
        return Ok(true);
    }
    let range = if take(&mut |f| &mut f.wrong_content_range) {
        format!("bytes {}-{}/{size}", a + 1, b + 1)
    } else {
        format!("bytes {a}-{b}/{size}")
    };
    let head = format!("HTTP/1.1 206 Partial Content\r\nContent-Length: {total}\r\nContent-Range: {range}\r\n\r\n");
    c.write_all(head.as_bytes())?;
    if take(&mut |f| &mut f.drop_mid_body) {
        c.write_all(&read(a, total / 2)?)?;
        let _ = c.shutdown(std::net::Shutdown::Both);
        return Ok(false);
    }
    if take(&mut |f| &mut f.stall) {
        c.write_all(&read(a, total / 2)?)?;
        std::thread::sleep(faults.stall_for);
        let _ = c.shutdown(std::net::Shutdown::Both);
        return Ok(false);
    }
    let start = Instant::now();
    let mut sent = 0usize;
    const CHUNK: usize = 64 << 10;
    while sent < total {
        let chunk = read(a + sent as u64, CHUNK.min(total - sent))?;
        // The chunk takes the link's next slot; it is sent, and the connection waits out the
        // later of its slot's end and its own rate.
        let link_due = (faults.link_rate > 0).then(|| {
            let mut free = s.link_free.lock().expect("poisoned");
            let at = (*free).max(Instant::now());
            *free = at + Duration::from_secs_f64(chunk.len() as f64 / faults.link_rate as f64);
            *free
        });
        c.write_all(&chunk)?;
        sent += chunk.len();
        if faults.rate > 0 {
            let due = start + Duration::from_secs_f64(sent as f64 / faults.rate as f64);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
        if let Some(due) = link_due {
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
        }
    }
    s.stats.bytes.fetch_add(total as u64, Ordering::Relaxed);
    Ok(true)
}
