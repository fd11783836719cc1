//! The web dashboard (`converge dashboard`) in a real browser: headless Chromium driven
//! through the DevTools protocol. `live_cluster_*` runs two agents, an allocator and a
//! trainer job and checks the page against `converge hosts` and `converge jobs`;
//! `scale_*` writes 50 hosts and 100 jobs into KV and times the first render and a live
//! update. Screenshots go to `target/test-output/dashboard/`.
//!
//! Chromium comes from `$CONVERGE_CHROMIUM` (`run-tests.sh` installs Debian's `chromium`
//! and sets it); without it the tests are skipped with a message, unless
//! `CONVERGE_REQUIRE_BROWSER=1` (CI), which makes them fail.
//!
//! The DevTools client is ours, over `--remote-debugging-pipe` (JSON messages, each ended by
//! a NUL byte, on file descriptors 3 and 4: what Puppeteer uses by default),
//! rather than a crate: `headless_chrome` and `chromiumoxide` bring a WebSocket stack
//! (`tungstenite`, not in Cargo.lock) and code generated from the whole protocol
//! (thousands of types, minutes of compilation on CI's two cores), for the dozen commands
//! used here. A pipe needs no port, no WebSocket handshake and no discovery of the
//! browser's endpoint; `sh` hands the two pipes over as fds 3 and 4.

use converge_bus::{Bus, unix_now};
use converge_common::{HostTelemetry, JobSpec, JobStatus, ProgressReport, subjects};
use converge_tests::*;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt as _, AsyncWriteExt as _, BufReader};
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::oneshot;

/// A laptop screen.
const WIDTH: u32 = 1366;
const HEIGHT: u32 = 768;

/// The Chromium binary, or `None` (with the reason printed) when the tests must be skipped.
fn chromium() -> Option<PathBuf> {
    let required = std::env::var("CONVERGE_REQUIRE_BROWSER").is_ok_and(|v| v == "1");
    match std::env::var_os("CONVERGE_CHROMIUM").filter(|v| !v.is_empty()) {
        Some(path) => {
            let path = PathBuf::from(path);
            assert!(
                path.exists(),
                "CONVERGE_CHROMIUM={} does not exist",
                path.display()
            );
            Some(path)
        }
        None if required => {
            panic!("CONVERGE_REQUIRE_BROWSER=1 but CONVERGE_CHROMIUM is not set")
        }
        None => {
            eprintln!(
                "skipped: CONVERGE_CHROMIUM is not set (run-tests.sh installs Debian's chromium \
                 and sets it; CONVERGE_REQUIRE_BROWSER=1 makes this a failure)"
            );
            None
        }
    }
}

/// `target/test-output/dashboard/`, created.
fn output_dir() -> PathBuf {
    let dir = repo_root().join("target/test-output/dashboard");
    std::fs::create_dir_all(&dir).expect("create target/test-output/dashboard");
    dir
}

// ---------------------------------------------------------------------------------------
// DevTools protocol over a pipe
// ---------------------------------------------------------------------------------------

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Value>>>>;

/// Headless Chromium and the browser-level DevTools connection.
struct Browser {
    child: Child,
    pgid: Option<u32>,
    commands: tokio::sync::Mutex<ChildStdin>,
    pending: Pending,
    next_id: AtomicU64,
    /// Uncaught exceptions of the page.
    exceptions: Arc<Mutex<Vec<String>>>,
    /// Console errors and warnings, and the browser's error log (failed loads).
    console: Arc<Mutex<Vec<String>>>,
    _profile: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium headless with a fresh profile; its own output goes to `log_path`.
    async fn launch(chromium: &Path, log_path: &Path) -> Self {
        let profile = tempfile::tempdir().expect("profile dir");
        let log = std::fs::File::create(log_path).expect("Chromium log file");
        let mut cmd = Command::new("sh");
        // fd 3: commands to the browser (our stdin pipe), fd 4: its answers (our stdout pipe).
        cmd.arg("-c")
            .arg(r#"exec "$@" 3<&0 4>&1 0</dev/null 1>&2"#)
            .arg("sh")
            .arg(chromium)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--remote-debugging-pipe",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--hide-scrollbars",
                "--mute-audio",
            ])
            .arg(format!("--window-size={WIDTH},{HEIGHT}"))
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .process_group(0)
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("start Chromium");
        let pgid = child.id();
        let commands = child.stdin.take().expect("stdin pipe");
        let answers = child.stdout.take().expect("stdout pipe");
        let pending: Pending = Arc::default();
        let exceptions: Arc<Mutex<Vec<String>>> = Arc::default();
        let console: Arc<Mutex<Vec<String>>> = Arc::default();
        tokio::spawn(read_messages(
            answers,
            pending.clone(),
            exceptions.clone(),
            console.clone(),
        ));
        let browser = Self {
            child,
            pgid,
            commands: tokio::sync::Mutex::new(commands),
            pending,
            next_id: AtomicU64::new(1),
            exceptions,
            console,
            _profile: profile,
        };
        let version = browser
            .call(None, "Browser.getVersion", json!({}))
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "Chromium does not answer on the DevTools pipe ({e}); its output is in {}",
                    log_path.display()
                )
            });
        eprintln!("browser: {}", version["product"].as_str().unwrap_or("?"));
        browser
    }

    /// Sends one command (to a page when `session` is given) and waits for its answer.
    async fn call(
        &self,
        session: Option<&str>,
        method: &str,
        params: Value,
    ) -> Result<Value, String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = s.into();
        }
        let mut bytes = serde_json::to_vec(&msg).expect("serialize a command");
        bytes.push(0);
        {
            let mut w = self.commands.lock().await;
            w.write_all(&bytes)
                .await
                .map_err(|e| format!("{method}: cannot write to Chromium: {e}"))?;
            w.flush().await.map_err(|e| format!("{method}: {e}"))?;
        }
        let reply = tokio::time::timeout(Duration::from_secs(30), rx)
            .await
            .map_err(|_| format!("{method}: no answer within 30 s"))?
            .map_err(|_| format!("{method}: Chromium closed the pipe"))?;
        match reply.get("error") {
            Some(e) => Err(format!("{method}: {e}")),
            None => Ok(reply["result"].clone()),
        }
    }

    /// Opens a tab of `WIDTH`×`HEIGHT` CSS pixels.
    async fn new_page(&self) -> Page<'_> {
        let target = self
            .call(None, "Target.createTarget", json!({ "url": "about:blank" }))
            .await
            .expect("create a tab");
        let attached = self
            .call(
                None,
                "Target.attachToTarget",
                json!({ "targetId": target["targetId"], "flatten": true }),
            )
            .await
            .expect("attach to the tab");
        let page = Page {
            browser: self,
            session: attached["sessionId"]
                .as_str()
                .expect("a session id")
                .to_string(),
        };
        for domain in ["Page.enable", "Runtime.enable", "Log.enable"] {
            page.call(domain, json!({})).await.expect(domain);
        }
        page.call(
            "Emulation.setDeviceMetricsOverride",
            json!({ "width": WIDTH, "height": HEIGHT, "deviceScaleFactor": 1, "mobile": false }),
        )
        .await
        .expect("set the viewport");
        page
    }

    fn exceptions(&self) -> Vec<String> {
        self.exceptions.lock().unwrap().clone()
    }

    fn console(&self) -> Vec<String> {
        self.console.lock().unwrap().clone()
    }

    /// Closes the browser (SIGKILL to its process group if it does not exit in 10 s).
    async fn close(mut self) {
        let _ = self.call(None, "Browser.close", json!({})).await;
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            eprintln!("Chromium did not exit within 10 s of Browser.close; killing it");
        }
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        // The browser's helpers (renderer, GPU, zygote) share its process group.
        if let Some(pgid) = self.pgid {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{pgid}")])
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// Reads NUL-separated messages from Chromium: answers go to their callers, the page's
/// exceptions and console errors are kept.
async fn read_messages(
    answers: tokio::process::ChildStdout,
    pending: Pending,
    exceptions: Arc<Mutex<Vec<String>>>,
    console: Arc<Mutex<Vec<String>>>,
) {
    let mut reader = BufReader::new(answers);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(0, &mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        if buf.last() == Some(&0) {
            buf.pop();
        }
        let Ok(msg) = serde_json::from_slice::<Value>(&buf) else {
            continue;
        };
        if let Some(id) = msg.get("id").and_then(Value::as_u64) {
            if let Some(tx) = pending.lock().unwrap().remove(&id) {
                let _ = tx.send(msg);
            }
            continue;
        }
        let p = &msg["params"];
        match msg["method"].as_str() {
            Some("Runtime.exceptionThrown") => {
                let d = &p["exceptionDetails"];
                let text = d["exception"]["description"]
                    .as_str()
                    .or(d["text"].as_str())
                    .unwrap_or("?");
                exceptions.lock().unwrap().push(format!(
                    "{text} ({}:{})",
                    d["url"].as_str().unwrap_or(""),
                    d["lineNumber"]
                ));
            }
            Some("Runtime.consoleAPICalled")
                if matches!(p["type"].as_str(), Some("error" | "warning" | "assert")) =>
            {
                let args: Vec<String> = p["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| match &a["value"] {
                        Value::String(s) => s.clone(),
                        Value::Null => a["description"].as_str().unwrap_or("").to_string(),
                        v => v.to_string(),
                    })
                    .collect();
                console.lock().unwrap().push(format!(
                    "console.{}: {}",
                    p["type"].as_str().unwrap_or("?"),
                    args.join(" ")
                ));
            }
            Some("Log.entryAdded")
                if matches!(p["entry"]["level"].as_str(), Some("error" | "warning")) =>
            {
                let e = &p["entry"];
                console.lock().unwrap().push(format!(
                    "log {}: {} {}",
                    e["level"].as_str().unwrap_or("?"),
                    e["text"].as_str().unwrap_or(""),
                    e["url"].as_str().unwrap_or("")
                ));
            }
            _ => {}
        }
    }
    // Chromium is gone: every caller still waiting gets an error.
    pending.lock().unwrap().clear();
}

/// One tab.
struct Page<'b> {
    browser: &'b Browser,
    session: String,
}

impl Page<'_> {
    async fn call(&self, method: &str, params: Value) -> Result<Value, String> {
        self.browser.call(Some(&self.session), method, params).await
    }

    async fn navigate(&self, url: &str) {
        let r = self
            .call("Page.navigate", json!({ "url": url }))
            .await
            .expect("navigate");
        if let Some(e) = r.get("errorText") {
            panic!("cannot load {url}: {e}");
        }
    }

    /// Evaluates `expr` in the page (promises awaited) and returns its value (`null` for
    /// `undefined`).
    async fn try_eval(&self, expr: &str) -> Result<Value, String> {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expr, "returnByValue": true, "awaitPromise": true }),
            )
            .await?;
        if let Some(d) = r.get("exceptionDetails") {
            return Err(format!(
                "{expr}: {}",
                d["exception"]["description"]
                    .as_str()
                    .unwrap_or("exception")
            ));
        }
        Ok(r["result"].get("value").cloned().unwrap_or(Value::Null))
    }

    async fn eval(&self, expr: &str) -> Value {
        self.try_eval(expr).await.unwrap_or_else(|e| panic!("{e}"))
    }

    /// Polls `expr` every 50 ms until it gives something other than `null`/`false`;
    /// on timeout saves `<shot>-timeout.png` and panics with `what`.
    async fn wait(&self, timeout: Duration, what: &str, shot: &str, expr: &str) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            match self.try_eval(expr).await {
                Ok(Value::Null | Value::Bool(false)) | Err(_) => {}
                Ok(v) => return v,
            }
            if Instant::now() >= deadline {
                let path = output_dir().join(format!("{shot}-timeout.png"));
                self.screenshot(&path).await;
                panic!(
                    "timed out after {timeout:?} waiting for {what} (screenshot {}; page \
                     exceptions: {:?}; console: {:?})",
                    path.display(),
                    self.browser.exceptions(),
                    self.browser.console()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Saves a screenshot of the whole page (beyond the viewport) as PNG.
    async fn screenshot(&self, path: &Path) {
        let metrics = self
            .call("Page.getLayoutMetrics", json!({}))
            .await
            .expect("layout metrics");
        let size = &metrics["cssContentSize"];
        let width = size["width"].as_f64().unwrap_or(f64::from(WIDTH)).ceil();
        let height = size["height"].as_f64().unwrap_or(f64::from(HEIGHT)).ceil();
        let shot = self
            .call(
                "Page.captureScreenshot",
                json!({
                    "format": "png",
                    "captureBeyondViewport": true,
                    "clip": { "x": 0, "y": 0, "width": width, "height": height, "scale": 1 },
                }),
            )
            .await
            .expect("capture a screenshot");
        let png = base64_decode(shot["data"].as_str().expect("screenshot data"));
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
        std::fs::write(path, png).expect("write the screenshot");
        eprintln!("screenshot: {} ({width}x{height})", path.display());
    }
}

/// Standard base64 (with padding), as the DevTools protocol sends binary data.
fn base64_decode(text: &str) -> Vec<u8> {
    fn value(c: u8) -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c:#x}"),
        }
    }
    let bytes: Vec<u8> = text.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &c)| n | (value(c) << (18 - 6 * i)));
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

// ---------------------------------------------------------------------------------------
// The dashboard process and what the page shows
// ---------------------------------------------------------------------------------------

/// `converge dashboard --listen 127.0.0.1:0` as a child process.
struct Dashboard {
    child: Child,
    /// `http://IP:PORT/`
    url: String,
}

impl Dashboard {
    async fn start(nats: &NatsServer) -> Self {
        let mut child = Command::new(bin_path("converge"))
            .arg("--nats-url")
            .arg(&nats.url)
            .args(["dashboard", "--listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("start converge dashboard");
        let stdout = child.stdout.take().expect("stdout pipe");
        let mut lines = BufReader::new(stdout).lines();
        let url = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines
                .next_line()
                .await
                .expect("read the dashboard's stdout")
            {
                if let Some(url) = line.strip_prefix("dashboard: ") {
                    return url.trim().to_string();
                }
            }
            panic!("converge dashboard exited without printing `dashboard: http://IP:PORT/`")
        })
        .await
        .expect("`dashboard: http://IP:PORT/` on stdout within 30 s");
        assert!(
            url.starts_with("http://127.0.0.1:") && url.ends_with('/'),
            "unexpected dashboard address {url:?}"
        );
        // Keep draining stdout so the process never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        eprintln!("dashboard at {url}");
        Self { child, url }
    }

    /// `IP:PORT`.
    fn addr(&self) -> String {
        self.url
            .trim_start_matches("http://")
            .trim_end_matches('/')
            .to_string()
    }

    /// SIGTERM: the process must exit, successfully, within 10 s.
    async fn stop(mut self) {
        let pid = self.child.id().expect("dashboard still running");
        let sent = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("run kill");
        assert!(sent.success());
        let status = tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .expect("converge dashboard exits within 10 s of SIGTERM")
            .expect("wait for converge dashboard");
        assert!(
            status.success(),
            "converge dashboard exited with {status} on SIGTERM"
        );
    }
}

/// What the page's tables show: host → (gpus, state), job → (phase, workers, generation).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Shown {
    hosts: BTreeMap<String, (String, String)>,
    jobs: BTreeMap<String, (String, String, String)>,
}

const READ_TABLES: &str = r#"(() => {
  const cell = (tr, f) => {
    const c = tr.querySelector(`td[data-field="${f}"]`);
    return c ? c.textContent.trim() : null;
  };
  return {
    hosts: [...document.querySelectorAll('table#hosts tbody tr[data-host]')]
      .map(tr => [tr.dataset.host, cell(tr, 'gpus'), cell(tr, 'state')]),
    jobs: [...document.querySelectorAll('table#jobs tbody tr[data-job]')]
      .map(tr => [tr.dataset.job, cell(tr, 'phase'), cell(tr, 'workers'), cell(tr, 'generation')]),
  };
})()"#;

async fn read_tables(page: &Page<'_>) -> Shown {
    let v = page.eval(READ_TABLES).await;
    let text = |v: &Value| v.as_str().unwrap_or("<missing cell>").to_string();
    let rows = |key: &str| v[key].as_array().cloned().unwrap_or_default();
    let hosts: BTreeMap<_, _> = rows("hosts")
        .iter()
        .map(|r| (text(&r[0]), (text(&r[1]), text(&r[2]))))
        .collect();
    let jobs: BTreeMap<_, _> = rows("jobs")
        .iter()
        .map(|r| (text(&r[0]), (text(&r[1]), text(&r[2]), text(&r[3]))))
        .collect();
    assert_eq!(hosts.len(), rows("hosts").len(), "a host has two rows: {v}");
    assert_eq!(jobs.len(), rows("jobs").len(), "a job has two rows: {v}");
    Shown { hosts, jobs }
}

impl Shown {
    /// The rows that differ from `expected`, one per line (`-` expected, `+` shown).
    fn diff(&self, expected: &Shown) -> String {
        fn rows<V: std::fmt::Debug + PartialEq>(
            what: &str,
            shown: &BTreeMap<String, V>,
            expected: &BTreeMap<String, V>,
            out: &mut Vec<String>,
        ) {
            let keys: std::collections::BTreeSet<&String> =
                shown.keys().chain(expected.keys()).collect();
            for k in keys {
                let (s, e) = (shown.get(k), expected.get(k));
                if s != e {
                    out.push(format!("{what} {k}: -{e:?} +{s:?}"));
                }
            }
        }
        let mut out = Vec::new();
        rows("host", &self.hosts, &expected.hosts, &mut out);
        rows("job", &self.jobs, &expected.jobs, &mut out);
        out.join("\n")
    }
}

/// Every SVG path whose `d` attribute is empty or holds `NaN`/`Infinity`.
async fn bad_paths(page: &Page<'_>) -> Vec<String> {
    let v = page
        .eval(
            r#"[...document.querySelectorAll('svg path')]
                 .filter(p => !p.getAttribute('d') || /NaN|Infinity/.test(p.getAttribute('d')))
                 .map(p => {
                   const svg = p.closest('svg');
                   const name = svg.dataset.curve || svg.id || 'svg';
                   return `${name} path.${p.getAttribute('class')}: ${p.getAttribute('d')}`;
                 })"#,
        )
        .await;
    serde_json::from_value(v).unwrap_or_default()
}

/// Facts about the layout at the test's screen size, printed for whoever reads the
/// screenshots: the page's size, elements wider than their box (scrolled sideways), ids
/// used more than once, and characters drawn from no installed font are not detectable
/// here, so the phase cells' texts are listed instead.
async fn print_layout(page: &Page<'_>) {
    let v = page
        .eval(
            r#"(() => {
                 const d = document.documentElement;
                 const wide = [...document.querySelectorAll('.scroll, table, svg, main, section')]
                   .filter(e => e.scrollWidth > e.clientWidth + 1 && getComputedStyle(e).overflowX !== 'visible')
                   .map(e => `${e.tagName.toLowerCase()}${e.id ? '#' + e.id : ''}${e.firstElementChild && e.firstElementChild.id ? '>#' + e.firstElementChild.id : ''}: ${e.scrollWidth} px in ${e.clientWidth} px`);
                 const ids = {};
                 document.querySelectorAll('[id]').forEach(e => { ids[e.id] = (ids[e.id] || 0) + 1; });
                 const dup = Object.entries(ids).filter(([, n]) => n > 1).map(([id, n]) => `${id} x${n}`);
                 return { page: `${d.scrollWidth}x${d.scrollHeight} in a ${innerWidth}x${innerHeight} window`,
                          scrolled_sideways: wide, duplicate_ids: dup };
               })()"#,
        )
        .await;
    eprintln!("layout: {v}");
}

/// Marks the current document; [`still_marked`] tells whether it was reloaded since.
async fn mark_document(page: &Page<'_>) {
    page.eval("window.__convergeTestMark = 1").await;
}

async fn still_marked(page: &Page<'_>) -> bool {
    page.eval("window.__convergeTestMark === 1").await == json!(true)
}

/// One HTTP/1.1 request on a fresh connection (which it should close, `Connection:
/// close`); the status code, or `None` when the server closed or reset the connection
/// without one.
fn http(addr: &str, request: &[u8]) -> Option<u16> {
    http_response(addr, request).map(|(status, _)| status)
}

/// As [`http`], with the response's body.
fn http_response(addr: &str, request: &[u8]) -> Option<(u16, Vec<u8>)> {
    http_exchange(addr, request).map(|(status, _, body)| (status, body))
}

/// As [`http`], with the response's head (status line and headers) and body.
fn http_exchange(addr: &str, request: &[u8]) -> Option<(u16, String, Vec<u8>)> {
    let mut s = std::net::TcpStream::connect(addr).expect("connect to the dashboard");
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    // A server that refuses a request early may close before reading all of it.
    let _ = s.write_all(request);
    let mut response = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => response.extend_from_slice(&buf[..n]),
        }
    }
    let head_end = response.windows(4).position(|w| w == b"\r\n\r\n");
    let head = String::from_utf8_lossy(&response[..head_end.unwrap_or(response.len())]);
    let status = head.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
    Some((
        status,
        head.to_string(),
        head_end.map_or_else(Vec::new, |e| response[e + 4..].to_vec()),
    ))
}

/// `GET path` with `Connection: close`.
fn get_request(addr: &str, path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").into_bytes()
}

/// One browser test at a time: each starts Chromium, and the live cluster's trainers must
/// not slow the scale test's timed render.
static ONE_BROWSER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A browser test's start, once no other browser test runs: the browser (`None`: the test
/// skips), the guard that keeps the others waiting, the output directory and a fresh
/// nats-server.
async fn browser_test() -> Option<(
    PathBuf,
    tokio::sync::MutexGuard<'static, ()>,
    PathBuf,
    NatsServer,
)> {
    let chromium = chromium()?;
    let one = ONE_BROWSER.lock().await;
    init_tracing();
    Some((chromium, one, output_dir(), NatsServer::start()))
}

// ---------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------

/// `converge --json args`'s output; panics with its stderr if it failed.
fn converge_json(nats: &NatsServer, args: &[&str]) -> Value {
    let stdout = succeeded(&converge(nats, &[&["--json"][..], args].concat()));
    serde_json::from_str(&stdout).expect("converge --json prints JSON")
}

/// The cells of queue team-a's row once the allocator's figures are in (quota, limit, in
/// use / fair share, borrowed, lent, weight, jobs), or `null` before.
const QUEUE_ROW_WITH_FIGURES: &str = r#"(() => {
  const tr = document.querySelector('table#queues tbody tr[data-queue="team-a"]');
  if (!tr || tr.closest('section').hidden) return null;
  const cell = f => tr.querySelector(`td[data-field="${f}"]`).textContent.trim();
  if (cell('share') === '—') return null;
  return ['quota', 'limit', 'share', 'borrowed', 'lent', 'weight', 'jobs'].map(cell);
})()"#;

/// What the page should show according to `converge hosts --json` and `converge jobs --json
/// --all`: busy GPUs are those with a non-zero utilization (as `converge hosts` counts).
fn expected_from_cli(nats: &NatsServer) -> Shown {
    let hosts = converge_json(nats, &["hosts"]);
    let jobs = converge_json(nats, &["jobs", "--all"]);
    let hosts = hosts
        .as_array()
        .expect("a host list")
        .iter()
        .map(|h| {
            let gpus = h["gpus"].as_array().expect("gpus");
            let busy = gpus
                .iter()
                .filter(|g| g["utilization_pct"].as_f64().unwrap_or(0.0) > 0.0)
                .count();
            let age = unix_now() - h["time"].as_f64().expect("time");
            let state = if age <= 15.0 { "live" } else { "lost" };
            (
                h["host"].as_str().unwrap().to_string(),
                (format!("{busy}/{}", gpus.len()), state.to_string()),
            )
        })
        .collect();
    let jobs = jobs
        .as_array()
        .expect("a job list")
        .iter()
        .map(|j| {
            let s = &j["status"];
            (
                j["spec"]["id"].as_str().unwrap().to_string(),
                (
                    s["phase"].as_str().unwrap_or("pending").to_string(),
                    s["world_size"].as_u64().unwrap_or(0).to_string(),
                    s["generation"].as_u64().unwrap_or(0).to_string(),
                ),
            )
        })
        .collect();
    Shown { hosts, jobs }
}

/// Two agents with two fake GPUs each, the allocator and one long `converge-trainer` job:
/// the page shows its fitted curve and the prediction without a reload, and its tables
/// agree with `converge hosts` and `converge jobs`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_cluster_page_matches_the_cli() {
    let Some((chromium, _one, out, nats)) = browser_test().await else {
        return;
    };
    let work = tempfile::tempdir().unwrap();
    let agents = start_agents(&nats, &["n1", "n2"], 2, work.path());
    let allocator = start_allocator(allocator_config(&nats, Duration::ZERO));
    let spec = TrainerJob::new("live", 1000)
        .workers(1, 4)
        .write(work.path());
    nats.submit(&spec);

    let dashboard = Dashboard::start(&nats).await;
    let browser = Browser::launch(&chromium, &out.join("chromium-live.log")).await;
    let page = browser.new_page().await;
    page.navigate(&dashboard.url).await;
    page.wait(
        Duration::from_secs(30),
        "the first render (body[data-ready=\"1\"])",
        "live",
        r#"document.body && document.body.dataset.ready === "1""#,
    )
    .await;
    mark_document(&page).await;

    // The job's curve: observed points, then the fit, the prediction and its band, all
    // arriving by live updates.
    let sel = r#"svg[data-curve="live"]"#;
    page.wait(
        Duration::from_secs(90),
        "the job's fitted curve and prediction",
        "live",
        &format!(r#"document.querySelector('{sel} path.prediction')"#),
    )
    .await;
    assert!(
        still_marked(&page).await,
        "the page reloaded instead of updating"
    );
    let paths = page
        .eval(&format!(
            r#"['observed', 'fit', 'prediction', 'band'].map(c => {{
                 const p = document.querySelector('{sel} path.' + c);
                 return [c, p ? (p.getAttribute('d') || '') : null];
               }})"#
        ))
        .await;
    for p in paths.as_array().unwrap() {
        let (class, d) = (p[0].as_str().unwrap(), &p[1]);
        let d = d
            .as_str()
            .unwrap_or_else(|| panic!("{sel} has no path.{class}"));
        assert!(
            d.len() > 3 && !d.contains("NaN") && !d.contains("Infinity"),
            "{sel} path.{class} has a bad d attribute: {d:?}"
        );
    }
    let bad = bad_paths(&page).await;
    assert!(
        bad.is_empty(),
        "paths without a usable d attribute: {bad:#?}"
    );
    assert_eq!(
        page.eval("!!document.querySelector('svg#timeline')").await,
        json!(true),
        "no svg#timeline"
    );

    // A queue created while the page is open: it appears in /api/state and in the Queues
    // table without a reload, with the allocator's figures once it publishes them; the job
    // is in the implicit default queue, which is listed because the job uses it.
    let created = converge_json(
        &nats,
        &[
            "queue",
            "create",
            "team-a",
            "--quota",
            "1",
            "--borrowing-limit",
            "0",
            "--weight",
            "2",
        ],
    );
    assert_eq!(created["name"], json!("team-a"), "{created}");
    let cells = page
        .wait(
            Duration::from_secs(30),
            "queue team-a in the Queues table with the allocator's figures",
            "live",
            QUEUE_ROW_WITH_FIGURES,
        )
        .await;
    let cells: Vec<String> = serde_json::from_value(cells.clone())
        .unwrap_or_else(|e| panic!("queue row cells {cells}: {e}"));
    eprintln!(
        "queue team-a shown as {cells:?} (quota, limit, in use / fair share, borrowed, lent, weight, jobs)"
    );
    assert_eq!(
        (&cells[0], &cells[1], &cells[3], &cells[5], &cells[6]),
        (
            &"1".to_string(),
            &"0".to_string(),
            &"0".to_string(),
            &"2".to_string(),
            &"0 / 0".to_string()
        ),
        "{cells:?}"
    );
    assert!(cells[2].starts_with("0 / "), "{cells:?}");
    let shown_queues = page
        .eval(
            r#"[...document.querySelectorAll('table#queues tbody tr[data-queue]')].map(tr => tr.dataset.queue)"#,
        )
        .await;
    assert_eq!(shown_queues, json!(["default", "team-a"]));
    assert_eq!(
        page.eval(
            r#"document.querySelector('table#jobs tbody tr[data-job="live"] td[data-field="queue"]').textContent.trim()"#
        )
        .await,
        json!("default · normal")
    );
    let (code, body) = http_response(
        &dashboard.addr(),
        &get_request(&dashboard.addr(), "/api/state"),
    )
    .expect("an answer to GET /api/state");
    assert_eq!(code, 200);
    let api: Value = serde_json::from_slice(&body).expect("/api/state is JSON");
    let queues = api["queues"].as_array().expect("/api/state has queues");
    let team = queues
        .iter()
        .find(|q| q["name"] == "team-a")
        .unwrap_or_else(|| panic!("no team-a in /api/state: {queues:?}"));
    assert_eq!(
        (
            &team["quota_gpus"],
            &team["borrowing_limit_gpus"],
            &team["weight"],
            &team["implicit"],
            &team["gpus_in_use"],
            &team["active_jobs"]
        ),
        (
            &json!(1),
            &json!(0),
            &json!(2.0),
            &json!(false),
            &json!(0),
            &json!(0)
        ),
        "{team}"
    );
    assert!(
        team["fair_share_gpus"].is_number() && team["updated_at"].is_number(),
        "{team}"
    );
    let default = queues
        .iter()
        .find(|q| q["name"] == "default")
        .unwrap_or_else(|| panic!("no default queue in /api/state: {queues:?}"));
    assert_eq!(
        (
            &default["implicit"],
            &default["borrowing_limit_gpus"],
            &default["active_jobs"]
        ),
        (&json!(true), &Value::Null, &json!(1)),
        "{default}"
    );
    let job = api["jobs"]
        .as_array()
        .and_then(|j| j.iter().find(|j| j["job"] == "live"))
        .expect("job live in /api/state");
    assert_eq!(
        (&job["queue"], &job["priority"]),
        (&json!("default"), &json!("normal")),
        "{job}"
    );
    assert!(
        still_marked(&page).await,
        "the page reloaded instead of updating"
    );

    // The tables against the CLI. Statuses and GPU utilization change between the two
    // reads (the job may grow): retry until a stable moment.
    let mut attempt = 0;
    let (shown, expected) = loop {
        attempt += 1;
        let expected = expected_from_cli(&nats);
        // Live updates reach the page within about 2 s.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let shown = read_tables(&page).await;
        if (shown == expected && expected_from_cli(&nats) == expected) || attempt == 8 {
            break (shown, expected);
        }
    };
    assert!(
        shown == expected,
        "the page disagrees with `converge hosts` / `converge jobs` after {attempt} attempts:\n{}",
        shown.diff(&expected)
    );
    assert_eq!(
        shown.hosts.keys().collect::<Vec<_>>(),
        ["n1", "n2"],
        "{shown:?}"
    );
    assert!(shown.jobs.contains_key("live"), "{shown:?}");
    eprintln!("page agrees with the CLI after {attempt} attempt(s): {shown:?}");

    page.screenshot(&out.join("live.png")).await;
    print_layout(&page).await;
    let exceptions = browser.exceptions();
    let console = browser.console();
    if !console.is_empty() {
        eprintln!("console errors and warnings: {console:#?}");
    }
    assert!(exceptions.is_empty(), "the page threw: {exceptions:#?}");

    browser.close().await;
    dashboard.stop().await;
    for r in agents.into_iter().chain([allocator]) {
        r.stop().await;
    }
}

const SCALE_HOSTS: usize = 50;
const SCALE_LOST: usize = 2;
const SCALE_GPUS: u32 = 8;
const SCALE_JOBS: usize = 100;
/// Rank 0's reports in the stream per job with a fitted curve (the allocator fits from them).
const SCALE_POINTS: usize = 30;

fn scale_host(i: usize) -> String {
    format!("node-{i:02}")
}

fn scale_job(i: usize) -> String {
    format!("job-{i:03}")
}

/// The scale test's jobs: their phase, size and generation, and where they run.
struct ScaleJob {
    id: String,
    phase: &'static str,
    workers: u32,
    generation: u64,
    /// (host index, gpu) per rank.
    placement: Vec<(usize, u32)>,
    /// `exp` curve `A·e^(−a·k)+b`: `[a, b, A]`.
    curve: Option<[f64; 3]>,
    samples: u64,
}

impl ScaleJob {
    fn loss_at(&self, k: f64) -> Option<f64> {
        self.curve.map(|[a, b, amp]| amp * (-a * k).exp() + b)
    }
}

/// 70 running, 10 pending, 5 restarting, 5 completed, 5 failed and 5 cancelled jobs of 1–8
/// workers, packed GPU by GPU over the live hosts (some across two hosts).
fn scale_jobs() -> Vec<ScaleJob> {
    let mut next_gpu = 0usize; // over live hosts × GPUs
    (0..SCALE_JOBS)
        .map(|i| {
            let phase = match i % 20 {
                0..=13 => "running",
                14 | 15 => "pending",
                16 => "restarting",
                17 => "completed",
                18 => "failed",
                _ => "cancelled",
            };
            let size = [1u32, 2, 4, 1, 2, 8, 3][i % 7];
            let placed = matches!(phase, "running" | "restarting");
            let placement = if placed {
                (0..size)
                    .map(|_| {
                        let g = next_gpu;
                        next_gpu += 1;
                        (g / SCALE_GPUS as usize, (g % SCALE_GPUS as usize) as u32)
                    })
                    .collect()
            } else {
                Vec::new()
            };
            let started = phase != "pending";
            ScaleJob {
                id: scale_job(i),
                phase,
                workers: if placed { size } else { 0 },
                generation: if started { 1 + (i % 5) as u64 } else { 0 },
                placement,
                curve: (started && phase != "failed").then(|| {
                    [
                        1.0 / (20_000.0 + 1_000.0 * (i % 10) as f64),
                        0.08 + 0.01 * (i % 7) as f64,
                        2.0 + 0.1 * (i % 5) as f64,
                    ]
                }),
                samples: if started { 30_000 + 500 * i as u64 } else { 0 },
            }
        })
        .collect()
}

fn scale_spec(j: &ScaleJob, now: f64) -> JobSpec {
    serde_json::from_value(json!({
        "id": j.id,
        "command": ["converge-trainer", "--dataset", "optdigits"],
        "min_workers": 1,
        "max_workers": 8,
        "labels": { "model": "softmax", "dataset": "optdigits" },
        "submitted_at": now - 3600.0,
        "cancelled": j.phase == "cancelled",
    }))
    .expect("a valid JobSpec")
}

fn scale_status(j: &ScaleJob, phase: &str, now: f64) -> JobStatus {
    let placement: Vec<Value> = j
        .placement
        .iter()
        .enumerate()
        .map(|(rank, (h, g))| json!({ "rank": rank, "host": scale_host(*h), "gpus": [g] }))
        .collect();
    let loss = j.loss_at(j.samples as f64);
    let finished = matches!(phase, "completed" | "failed" | "cancelled");
    let mut s = json!({
        "job": j.id,
        "phase": phase,
        "generation": j.generation,
        "world_size": j.workers,
        "placement": placement,
        "master_port": if j.workers > 0 { Some(20_000 + j.generation) } else { None },
        "step": j.samples / 32,
        "samples": j.samples,
        "first_loss": j.loss_at(0.0),
        "loss": loss,
        "eval_loss": loss.map(|l| l * 1.05),
        "curve": j.curve.map(|p| json!({ "family": "exp", "params": p, "rmse": 0.01, "points": SCALE_POINTS })),
        "predicted_loss": j.loss_at(j.samples as f64 + 30.0 * 400.0 * f64::from(j.workers)),
        "samples_per_s": (j.workers > 0).then(|| 400.0 * f64::from(j.workers)),
        "submitted_at": now - 3600.0,
        "started_at": (j.generation > 0).then_some(now - 3000.0),
        "finished_at": finished.then_some(now - 60.0),
        "updated_at": now,
        "message": match phase {
            "failed" => Some("rank 0 exited with code 1 more than 3 times"),
            "cancelled" => Some("cancelled by the user"),
            _ => None,
        },
    });
    // One allocation change per generation: started, then grown, shrunk or moved, 8
    // minutes apart.
    let causes = ["grown", "shrunk", "moved"];
    let allocations: Vec<Value> = (1..=j.generation)
        .map(|g| {
            let workers = if g == j.generation {
                j.workers.max(1)
            } else {
                1 + (g as u32 % 3)
            };
            let cause = if g == 1 {
                "started"
            } else {
                causes[g as usize % 3]
            };
            json!({
                "time": now - 3000.0 + 480.0 * (g - 1) as f64,
                "generation": g,
                "from_workers": if g == 1 { 0 } else { 1 + ((g - 1) as u32 % 3) },
                "workers": workers,
                "hosts": 1,
                "cause": cause,
                "reason": format!("job {}: {cause} by the quality policy (generation {g})", j.id),
            })
        })
        .collect();
    if !allocations.is_empty() {
        s["allocations"] = allocations.into();
    }
    if phase == "completed" {
        s["end"] = json!({
            "reason": "converged",
            "loss": loss,
            "predicted_loss": j.curve.map(|c| c[1]),
            "gpu_hours": 0.5,
        });
    }
    serde_json::from_value(s).expect("a valid JobStatus")
}

/// Telemetry of host `i` at `time`: a GPU is busy (utilized, with a running worker) when a
/// placed job's rank holds it.
fn scale_telemetry(i: usize, jobs: &[ScaleJob], time: f64) -> HostTelemetry {
    let mut workers = Vec::new();
    let mut busy = vec![false; SCALE_GPUS as usize];
    for j in jobs {
        for (rank, (h, g)) in j.placement.iter().enumerate() {
            if *h == i {
                busy[*g as usize] = true;
                workers.push(json!({
                    "job": j.id, "generation": j.generation, "rank": rank,
                    "phase": if j.phase == "restarting" { "stopping" } else { "running" },
                    "pid": 10_000 + rank, "restarts": 0, "last_exit_code": null, "gpus": [g],
                }));
            }
        }
    }
    let gpus: Vec<Value> = busy
        .iter()
        .enumerate()
        .map(|(g, &b)| {
            json!({
                "index": g, "uuid": format!("GPU-fake-{i:02}-{g}"), "name": "Fake H100",
                "memory_total_bytes": 80u64 << 30,
                "memory_used_bytes": if b { 61u64 << 30 } else { 0 },
                "utilization_pct": if b { 93.0 } else { 0.0 },
                "power_mw": if b { 610_000 } else { 70_000 },
            })
        })
        .collect();
    serde_json::from_value(json!({
        "host": scale_host(i),
        "addr": format!("10.0.0.{}", 10 + i),
        "time": time,
        "agent_version": "0.1.0",
        "gpu_source": "fake",
        "gpus": gpus,
        "nics": [{ "name": "eth0", "rx_bytes_per_s": 1.2e8, "tx_bytes_per_s": 1.1e8, "link_speed_bps": 100_000_000_000u64 }],
        "cpu_pct": 37.5,
        "memory_used_bytes": 200u64 << 30,
        "memory_total_bytes": 1024u64 << 30,
        "workers": workers,
        "malformed_progress_lines": 0,
    }))
    .expect("valid HostTelemetry")
}

/// Writes the scale test's cluster into KV and the progress stream.
async fn write_scale_cluster(bus: &Bus, jobs: &[ScaleJob]) {
    let now = unix_now();
    for j in jobs {
        bus.put(&bus.jobs, &j.id, &scale_spec(j, now))
            .await
            .unwrap();
        bus.put(&bus.status, &j.id, &scale_status(j, j.phase, now))
            .await
            .unwrap();
    }
    for j in jobs.iter().filter(|j| j.curve.is_some()) {
        let host = j.placement.first().map_or(0, |p| p.0);
        for n in 1..=SCALE_POINTS {
            let k = j.samples as f64 * n as f64 / SCALE_POINTS as f64;
            let loss = j.loss_at(k).unwrap() * (1.0 + 0.03 * (n as f64 * 1.7).sin());
            let mut r = ProgressReport::new(
                j.id.parse().unwrap(),
                j.generation,
                0,
                scale_host(host).parse().unwrap(),
                k as u64 / 32,
                k as u64,
                loss,
                now - 2.0 * (SCALE_POINTS - n) as f64,
            );
            r.line.eval_loss = Some(loss * 1.05);
            bus.publish_acked(subjects::progress(&r.job, &r.host), &r)
                .await
                .unwrap();
        }
    }
    for i in 0..SCALE_HOSTS {
        let time = if i >= SCALE_HOSTS - SCALE_LOST {
            now - 3600.0
        } else {
            now
        };
        bus.put(&bus.hosts, &scale_host(i), &scale_telemetry(i, jobs, time))
            .await
            .unwrap();
    }
}

/// What the page should show for the scale test's cluster.
fn scale_expected(jobs: &[ScaleJob]) -> Shown {
    let hosts = (0..SCALE_HOSTS)
        .map(|i| {
            let busy = jobs
                .iter()
                .flat_map(|j| &j.placement)
                .filter(|p| p.0 == i)
                .count();
            let state = if i >= SCALE_HOSTS - SCALE_LOST {
                "lost"
            } else {
                "live"
            };
            (
                scale_host(i),
                (format!("{busy}/{SCALE_GPUS}"), state.to_string()),
            )
        })
        .collect();
    let jobs = jobs
        .iter()
        .map(|j| {
            (
                j.id.clone(),
                (
                    j.phase.to_string(),
                    j.workers.to_string(),
                    j.generation.to_string(),
                ),
            )
        })
        .collect();
    Shown { hosts, jobs }
}

/// The checks of a test that failed: the test goes on and fails at its end with all of them.
#[derive(Debug, Default)]
struct Failures(Vec<String>);

impl Failures {
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            let what = what();
            eprintln!("check failed: {what}");
            self.0.push(what);
        }
    }

    fn assert_none(self) {
        assert!(
            self.0.is_empty(),
            "{} check(s) failed:\n- {}",
            self.0.len(),
            self.0.join("\n- ")
        );
    }
}

/// 50 hosts of 8 GPUs and 100 jobs written straight into KV (no allocator): the page
/// renders them within a second, shows a status change within 2 s without a reload, and
/// serves nothing but reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scale_first_render_and_live_update_latency() {
    let Some((chromium, _one, out, nats)) = browser_test().await else {
        return;
    };
    let bus = nats.bus().await;
    let jobs = scale_jobs();
    write_scale_cluster(&bus, &jobs).await;
    // The live hosts keep heartbeating, as agents do (every 2 s here).
    let heartbeat = {
        let bus = bus.clone();
        let jobs = scale_jobs();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(2)).await;
                for i in 0..SCALE_HOSTS - SCALE_LOST {
                    let t = scale_telemetry(i, &jobs, unix_now());
                    let _ = bus.put(&bus.hosts, &scale_host(i), &t).await;
                }
            }
        })
    };
    let expected = scale_expected(&jobs);
    let mut failures = Failures::default();

    let dashboard = Dashboard::start(&nats).await;
    // The first picture served is the whole cluster, never the part read so far (503
    // until then is fine).
    let addr = dashboard.addr();
    let first = tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match http_response(&addr, &get_request(&addr, "/api/state")) {
                Some((200, body)) => return body,
                Some((503, _)) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => panic!("GET /api/state answered {other:?}"),
            }
        }
    })
    .await
    .unwrap();
    let first: Value = serde_json::from_slice(&first).expect("/api/state is JSON");
    let counts = |key: &str| first[key].as_array().map_or(0, Vec::len);
    let (hosts, jobs_served) = (counts("hosts"), counts("jobs"));
    failures.check((hosts, jobs_served) == (SCALE_HOSTS, SCALE_JOBS), || {
        format!(
            "the first /api/state served (version {}) holds {hosts} hosts and {jobs_served} \
             jobs of {SCALE_HOSTS} and {SCALE_JOBS}: a picture built before the KV buckets \
             were read",
            first["version"]
        )
    });

    let browser = Browser::launch(&chromium, &out.join("chromium-scale.log")).await;
    let page = browser.new_page().await;
    page.navigate(&dashboard.url).await;
    let ms = page
        .wait(
            Duration::from_secs(30),
            "the first render (body[data-ready=\"1\"])",
            "scale",
            r#"document.body && document.body.dataset.ready === "1"
               && document.body.dataset.firstRenderMs"#,
        )
        .await;
    let first_render_ms: f64 = ms
        .as_str()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("data-first-render-ms is not a number: {ms}"));
    eprintln!("first render of {SCALE_HOSTS} hosts and {SCALE_JOBS} jobs: {first_render_ms:.0} ms");
    failures.check(first_render_ms <= 1000.0, || {
        format!("first render took {first_render_ms} ms (limit 1000 ms)")
    });
    mark_document(&page).await;

    // The first render is the whole cluster.
    let shown = read_tables(&page).await;
    failures.check(shown == expected, || {
        format!(
            "the first render disagrees with what was written:\n{}",
            shown.diff(&expected)
        )
    });
    // The whole cluster arrives anyway.
    page.wait(
        Duration::from_secs(10),
        "every job's row",
        "scale",
        &format!(
            "document.querySelectorAll('table#jobs tbody tr[data-job]').length === {SCALE_JOBS}"
        ),
    )
    .await;

    // A running job completes: the row follows within 2 s, without a reload. The page
    // itself records when it first shows the new phase.
    let job = &jobs[7];
    assert_eq!(job.phase, "running");
    page.eval(&format!(
        r#"(() => {{
             window.__convergeSeenAt = null;
             const check = () => {{
               const c = document.querySelector(
                 'table#jobs tbody tr[data-job="{id}"] td[data-field="phase"]');
               if (window.__convergeSeenAt === null && c && c.textContent.trim() === 'completed')
                 window.__convergeSeenAt = Date.now();
             }};
             new MutationObserver(check).observe(document.body,
               {{ subtree: true, childList: true, characterData: true, attributes: true }});
           }})()"#,
        id = job.id
    ))
    .await;
    let version_before = page.eval("document.body.dataset.version").await;
    let changed_at_ms = unix_now() * 1000.0;
    let mut done = scale_status(job, "completed", unix_now());
    done.world_size = 0;
    done.placement.clear();
    bus.put(&bus.status, &job.id, &done).await.unwrap();
    let seen = page
        .wait(
            Duration::from_secs(10),
            "the completed phase in the job's row",
            "scale",
            "window.__convergeSeenAt",
        )
        .await;
    let latency_ms = seen.as_f64().unwrap() - changed_at_ms;
    eprintln!("live update (KV write to the row showing it): {latency_ms:.0} ms");
    failures.check(latency_ms <= 2000.0, || {
        format!("the row showed the new phase after {latency_ms:.0} ms (limit 2000 ms)")
    });
    failures.check(still_marked(&page).await, || {
        "the page reloaded instead of updating".into()
    });
    let version_after = page.eval("document.body.dataset.version").await;
    failures.check(version_after != version_before, || {
        format!("data-version did not change ({version_after})")
    });

    // Read-only, and a huge request header is refused while the state still answers.
    let addr = dashboard.addr();
    let codes = tokio::task::spawn_blocking(move || {
        let req = |method: &str, path: &str| {
            format!(
                "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 2\r\n\
                 Content-Type: application/json\r\nConnection: close\r\n\r\n{{}}"
            )
        };
        let big = format!(
            "GET /api/state HTTP/1.1\r\nHost: {addr}\r\nX-Filler: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(1 << 20)
        );
        [
            (
                "POST /api/state",
                http(&addr, req("POST", "/api/state").as_bytes()),
            ),
            (
                "DELETE /api/state",
                http(&addr, req("DELETE", "/api/state").as_bytes()),
            ),
            ("PUT /", http(&addr, req("PUT", "/").as_bytes())),
            (
                "GET /no-such-page",
                http(&addr, &get_request(&addr, "/no-such-page")),
            ),
            ("1 MiB header", http(&addr, big.as_bytes())),
            (
                "GET /api/state after it",
                http(&addr, &get_request(&addr, "/api/state")),
            ),
            // DNS rebinding: a page of another name resolved to 127.0.0.1.
            (
                "GET /api/state as evil.example",
                http(&addr, &get_request("evil.example:80", "/api/state")),
            ),
        ]
    })
    .await
    .unwrap();
    eprintln!("HTTP: {codes:?}");
    for (what, code) in codes {
        let ok = match what {
            "GET /no-such-page" => code == Some(404),
            // Refused: an error status, or the connection closed without an answer.
            "1 MiB header" => code.is_none_or(|c| c >= 400),
            "GET /api/state after it" => code == Some(200),
            "GET /api/state as evil.example" => code == Some(403),
            _ => matches!(code, Some(404 | 405)),
        };
        failures.check(ok, || format!("{what} answered {code:?}"));
    }

    // Every answer forbids sniffing and limits the page to its own script and styles.
    let addr = dashboard.addr();
    let head = tokio::task::spawn_blocking(move || {
        http_exchange(&addr, &get_request(&addr, "/")).map(|(_, head, _)| head)
    })
    .await
    .unwrap()
    .unwrap_or_default()
    .to_ascii_lowercase();
    failures.check(
        head.contains("x-content-type-options: nosniff")
            && head.contains("content-security-policy: default-src 'none'; script-src 'self'"),
        || format!("GET / lacks nosniff or the CSP:\n{head}"),
    );

    // Loaded again, now that the dashboard has read everything: the first render of the
    // whole cluster.
    page.navigate(&dashboard.url).await;
    let ms = page
        .wait(
            Duration::from_secs(30),
            "the first render after a reload",
            "scale",
            r#"window.__convergeTestMark === undefined && document.body
               && document.body.dataset.ready === "1" && document.body.dataset.firstRenderMs"#,
        )
        .await;
    let reload_ms: f64 = ms.as_str().and_then(|s| s.parse().ok()).unwrap_or(f64::NAN);
    let shown = read_tables(&page).await;
    eprintln!("first render after a reload: {reload_ms:.0} ms");
    failures.check(reload_ms <= 1000.0, || {
        format!("the first render after a reload took {reload_ms} ms (limit 1000 ms)")
    });
    let mut expected = expected;
    expected.jobs.get_mut(&job.id).expect("the completed job").0 = "completed".into();
    expected.jobs.get_mut(&job.id).unwrap().1 = "0".into();
    failures.check(shown == expected, || {
        format!(
            "the first render after a reload disagrees with KV:\n{}",
            shown.diff(&expected)
        )
    });

    let curves = page
        .eval(
            r#"[...document.querySelectorAll('svg[data-curve]')]
                 .filter(s => s.querySelector('path.prediction'))
                 .map(s => s.dataset.curve)"#,
        )
        .await;
    let mut curves: Vec<&str> = curves
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    curves.sort_unstable();
    let with_curve: Vec<&str> = jobs
        .iter()
        .filter(|j| j.curve.is_some())
        .map(|j| j.id.as_str())
        .collect();
    // An ended job keeps its fit but has no future to predict.
    let ended = ["completed", "failed", "cancelled"];
    let predicting: Vec<&str> = jobs
        .iter()
        .filter(|j| j.curve.is_some() && !ended.contains(&j.phase) && j.id != job.id)
        .map(|j| j.id.as_str())
        .collect();
    failures.check(curves == predicting, || {
        format!(
            "svg[data-curve] with a path.prediction: {curves:?}; expected one per fitted \
             active job: {predicting:?}"
        )
    });
    // Each curve shows the job's reports.
    let no_points = page
        .eval(&format!(
            r#"{with_curve:?}.filter(id => {{
                 const p = document.querySelector(`svg[data-curve="${{id}}"] path.observed`);
                 return !p || (p.getAttribute('d') || '').length < 8;
               }})"#
        ))
        .await;
    failures.check(no_points == json!([]), || {
        format!("jobs with progress reports but no observed points: {no_points}")
    });
    let bad = bad_paths(&page).await;
    failures.check(bad.is_empty(), || {
        format!("paths without a usable d attribute: {bad:#?}")
    });

    page.screenshot(&out.join("scale.png")).await;
    print_layout(&page).await;

    // The state's shape (the contract of /api/state).
    let api = page.eval("fetch('/api/state').then(r => r.json())").await;
    failures.check(
        api["version"].is_u64() && api["generated_at"].as_f64().is_some_and(|t| t > 1e9),
        || {
            format!(
                "version {} generated_at {}",
                api["version"], api["generated_at"]
            )
        },
    );
    let empty = Vec::new();
    let hosts = api["hosts"].as_array().unwrap_or(&empty);
    failures.check(hosts.len() == SCALE_HOSTS, || {
        format!("/api/state has {} hosts", hosts.len())
    });
    for h in hosts {
        failures.check(
            h["host"].is_string()
                && h["gpus_total"].as_u64() == Some(u64::from(SCALE_GPUS))
                && h["gpus_busy"].is_u64()
                && h["lost"].is_boolean(),
            || format!("host entry {h}"),
        );
    }
    let api_jobs = api["jobs"].as_array().unwrap_or(&empty);
    failures.check(api_jobs.len() == SCALE_JOBS, || {
        format!("/api/state has {} jobs", api_jobs.len())
    });
    for j in api_jobs {
        failures.check(
            j["job"].is_string()
                && j["phase"].is_string()
                && j["workers"].is_u64()
                && j["generation"].is_u64()
                && (j["queue_position"].is_null() || j["queue_position"].is_u64())
                && j["queue"] == "default"
                && j["priority"] == "normal",
            || format!("job entry {j}"),
        );
    }

    let exceptions = browser.exceptions();
    let console = browser.console();
    if !console.is_empty() {
        eprintln!("console errors and warnings: {console:#?}");
    }
    failures.check(exceptions.is_empty(), || {
        format!("the page threw: {exceptions:#?}")
    });
    heartbeat.abort();
    browser.close().await;
    dashboard.stop().await;
    failures.assert_none();
}
