//! Rendezvous through the master and ring all-reduce over TCP.
//!
//! Rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`. Every rank, rank 0 included,
//! binds a ring listener on an ephemeral port. Every other rank connects to the master and
//! sends one JSON line with its rank, world size, generation and ring port. The master
//! records the address it observes for each peer (so ranks on other hosts are reached on
//! the interface they actually used), checks that everybody agrees on the world size and
//! generation, and answers each rank with the full list of ring addresses. Rank 0's own
//! entry in that list is the local address of the master's connection with that peer,
//! which is by construction an address the peer can reach.
//!
//! A joining rank whose connection closes before the reply connects again until the
//! rendezvous deadline. A rank that joins while its earlier registration's connection is
//! still open is refused ("joined twice"); one whose earlier connection has closed (its
//! process restarted, or the connection broke after the master registered it) takes its
//! place. Before sending the list, the master drops every registered rank whose connection
//! has closed and waits for it again; a rank that dies after that check, while the list is
//! being sent, still fails the rendezvous (its generation restarts).
//!
//! Ring: each rank connects to rank `(r + 1) % W` and accepts from `(r - 1) % W`. An
//! all-reduce is a reduce-scatter followed by an all-gather over `W` chunks. Each chunk's
//! sum is computed by exactly one rank and then copied, so every rank ends with
//! bit-identical results. In every exchange, sending runs on a scoped thread while the
//! calling thread receives, so large vectors cannot deadlock on full socket buffers.
//!
//! The training loop times every [`Ring::all_reduce_sum`] of a step and reports the mean
//! per step as the progress lines' `sync_s`; it includes the time spent waiting for slower
//! ranks to join the exchange.
//!
//! The parameter-server mode ([`crate::ps`]) uses the same rendezvous through
//! [`rendezvous`]: there every rank also sends `CONVERGE_NUM_PS`, the master refuses ranks
//! that disagree with it, and the "ring port" a rank sends is its parameter-server listener
//! (0 for workers, which listen on nothing).

use std::fmt;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use serde::{Deserialize, Serialize};

/// How long a blocking socket call waits before the loops around it look at deadlines
/// and the termination flag again.
pub(crate) const POLL: Duration = Duration::from_millis(200);
/// After a termination request, how long an exchange may go without progress before it
/// gives up instead of waiting the full I/O timeout.
pub(crate) const TERMINATION_GRACE: Duration = Duration::from_secs(5);
/// Magic bytes that open a ring connection.
const RING_MAGIC: &[u8; 4] = b"CVRG";

/// Who this rank is and how to reach the master.
#[derive(Clone, Debug)]
pub struct RingConfig {
    /// This worker's rank, `0..world_size`.
    pub rank: usize,
    /// Number of ranks in the ring.
    pub world_size: usize,
    /// The job generation; all ranks must agree on it.
    pub generation: u64,
    /// Host name or IP address of rank 0.
    pub master_addr: String,
    /// Port rank 0 listens on for the rendezvous.
    pub master_port: u16,
    /// How long the rendezvous (master connection and ring connections) may take.
    pub rendezvous_timeout: Duration,
    /// How long an all-reduce exchange may go without progress before the peer is
    /// declared failed.
    pub io_timeout: Duration,
}

/// The operation stopped because the termination flag was set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted;

impl fmt::Display for Interrupted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("interrupted by a termination signal")
    }
}

impl std::error::Error for Interrupted {}

#[derive(Debug, Serialize, Deserialize)]
struct Hello {
    rank: usize,
    world_size: usize,
    generation: u64,
    ring_port: u16,
    /// `CONVERGE_NUM_PS` of the sender (0 in ring mode; absent from older trainers).
    #[serde(default)]
    num_ps: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct Reply {
    ok: bool,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    addresses: Vec<String>,
}

/// A connected ring of `world_size` ranks.
#[derive(Debug)]
pub struct Ring {
    rank: usize,
    world_size: usize,
    /// Connection to rank `(rank + 1) % world_size`; this rank sends on it.
    next: TcpStream,
    /// Connection from rank `(rank - 1) % world_size`; this rank receives on it.
    prev: TcpStream,
    io_timeout: Duration,
    cancel: Arc<AtomicBool>,
    /// Number of exchanges so far, sent along to detect ranks that fell out of step.
    seq: u64,
}

impl Ring {
    /// Performs the rendezvous and connects the ring. Rank 0 binds the master port
    /// itself. Returns an [`Interrupted`] error if `cancel` is set meanwhile.
    pub fn connect(cfg: &RingConfig, cancel: Arc<AtomicBool>) -> Result<Ring> {
        Ring::connect_with_listener(cfg, None, cancel)
    }

    /// Like [`Ring::connect`], but rank 0 may be handed an already bound master listener
    /// (tests use this to get an ephemeral port without races).
    pub fn connect_with_listener(
        cfg: &RingConfig,
        master: Option<TcpListener>,
        cancel: Arc<AtomicBool>,
    ) -> Result<Ring> {
        let deadline = check_ranks(cfg, "ring")?;
        let ring_listener =
            TcpListener::bind(("0.0.0.0", 0)).context("cannot bind the ring listener")?;
        let ring_port = ring_listener.local_addr()?.port();
        let addresses = rendezvous_until(cfg, 0, master, ring_port, deadline, &cancel)?;
        let w = cfg.world_size;
        let next_rank = (cfg.rank + 1) % w;
        let prev_rank = (cfg.rank + w - 1) % w;
        let next_addr: SocketAddr = addresses[next_rank]
            .parse()
            .with_context(|| format!("bad ring address {:?}", addresses[next_rank]))?;
        let mut next = connect_with_retry(next_addr, deadline, &cancel)
            .with_context(|| format!("cannot connect to rank {next_rank} at {next_addr}"))?;
        let mut hs = Vec::with_capacity(16);
        hs.extend_from_slice(RING_MAGIC);
        hs.extend_from_slice(&(cfg.rank as u32).to_le_bytes());
        hs.extend_from_slice(&cfg.generation.to_le_bytes());
        next.write_all(&hs)?;
        let prev = accept_prev(&ring_listener, prev_rank, cfg.generation, deadline, &cancel)?;
        for s in [&next, &prev] {
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(POLL))?;
            s.set_write_timeout(Some(POLL))?;
        }
        eprintln!(
            "rank {}/{w}: ring connected (sending to rank {next_rank} at {next_addr}, receiving from rank {prev_rank})",
            cfg.rank
        );
        Ok(Ring {
            rank: cfg.rank,
            world_size: w,
            next,
            prev,
            io_timeout: cfg.io_timeout,
            cancel,
            seq: 0,
        })
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Replaces `data` on every rank with the element-wise sum over all ranks. All ranks
    /// must call this with vectors of the same length; the results are bit-identical.
    pub fn all_reduce_sum(&mut self, data: &mut [f64]) -> Result<()> {
        let (w, r, n) = (self.world_size, self.rank, data.len());
        let chunk = |c: usize| (c * n / w)..((c + 1) * n / w);
        // Reduce-scatter: after W-1 exchanges, rank r holds the full sum of chunk r+1.
        for s in 0..w - 1 {
            let send = chunk((r + w - s) % w);
            let recv = chunk((r + 2 * w - s - 1) % w);
            let got = self.exchange(&data[send], recv.len())?;
            for (d, v) in data[recv].iter_mut().zip(got) {
                *d += v;
            }
        }
        // All-gather: the finished chunks travel around the ring.
        for s in 0..w - 1 {
            let send = chunk((r + 1 + w - s) % w);
            let recv = chunk((r + w - s) % w);
            let got = self.exchange(&data[send], recv.len())?;
            data[recv].copy_from_slice(&got);
        }
        Ok(())
    }

    /// Sends `send` to the next rank while receiving `recv_len` values from the previous.
    fn exchange(&mut self, send: &[f64], recv_len: usize) -> Result<Vec<f64>> {
        self.seq += 1;
        let seq = self.seq;
        let mut out = Vec::with_capacity(16 + send.len() * 8);
        out.extend_from_slice(&seq.to_le_bytes());
        out.extend_from_slice(&(send.len() as u64).to_le_bytes());
        for v in send {
            out.extend_from_slice(&v.to_le_bytes());
        }
        let mut inbuf = vec![0u8; 16 + recv_len * 8];
        // This records which direction failed first (1 receiving, 2 sending), so that the
        // error reported is the cause rather than the other direction giving up.
        let failed = AtomicU8::new(0);
        let w = self.world_size;
        let next_rank = (self.rank + 1) % w;
        let prev_rank = (self.rank + w - 1) % w;
        let (sent, received) = thread::scope(|scope| {
            let writer = scope.spawn(|| {
                let r = io_loop(
                    &self.next,
                    &mut IoBuf::Write(&out),
                    self.io_timeout,
                    &self.cancel,
                    &failed,
                );
                if r.is_err() {
                    let _ = failed.compare_exchange(0, 2, Ordering::SeqCst, Ordering::SeqCst);
                    let _ = self.prev.shutdown(Shutdown::Read);
                }
                r
            });
            let received = io_loop(
                &self.prev,
                &mut IoBuf::Read(&mut inbuf),
                self.io_timeout,
                &self.cancel,
                &failed,
            );
            if received.is_err() {
                let _ = failed.compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst);
                let _ = self.next.shutdown(Shutdown::Write);
            }
            let sent = writer
                .join()
                .unwrap_or_else(|_| Err(anyhow!("the sending thread panicked")));
            (sent, received)
        });
        let received = received.with_context(|| format!("receiving from rank {prev_rank} failed"));
        let sent = sent.with_context(|| format!("sending to rank {next_rank} failed"));
        if failed.load(Ordering::SeqCst) == 2 {
            sent?;
            received?;
        } else {
            received?;
            sent?;
        }
        let their_seq = u64::from_le_bytes(inbuf[0..8].try_into()?);
        let their_len = u64::from_le_bytes(inbuf[8..16].try_into()?);
        ensure!(
            their_seq == seq && their_len == recv_len as u64,
            "rank {prev_rank} is out of step (exchange {their_seq} of {their_len} values, expected exchange {seq} of {recv_len})"
        );
        Ok(inbuf[16..]
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect())
    }
}

/// Performs the rendezvous alone and returns the address list, one `ip:port` per rank:
/// the port each rank sent (`own_port` for this one) at the address the master observed
/// for it. Rank 0 serves it (on `master` if given, else it binds `MASTER_PORT`); every
/// rank must pass the same `num_ps`. Entry 0 is reachable only by ranks other than 0.
pub fn rendezvous(
    cfg: &RingConfig,
    num_ps: usize,
    master: Option<TcpListener>,
    own_port: u16,
    cancel: &AtomicBool,
) -> Result<Vec<String>> {
    let deadline = check_ranks(cfg, "rendezvous")?;
    rendezvous_until(cfg, num_ps, master, own_port, deadline, cancel)
}

/// Checks that `cfg` has two ranks or more and its rank among them (`what`, ring or
/// rendezvous, names the group in the error); returns the rendezvous deadline.
fn check_ranks(cfg: &RingConfig, what: &str) -> Result<Instant> {
    ensure!(cfg.world_size >= 2, "a {what} needs at least two ranks");
    ensure!(
        cfg.rank < cfg.world_size,
        "rank {} is not below world size {}",
        cfg.rank,
        cfg.world_size
    );
    Ok(Instant::now() + cfg.rendezvous_timeout)
}

fn rendezvous_until(
    cfg: &RingConfig,
    num_ps: usize,
    master: Option<TcpListener>,
    own_port: u16,
    deadline: Instant,
    cancel: &AtomicBool,
) -> Result<Vec<String>> {
    if cfg.rank == 0 {
        let master = match master {
            Some(l) => l,
            None => bind_with_retry(cfg.master_port, deadline, cancel)?,
        };
        serve_rendezvous(cfg, num_ps, master, own_port, deadline, cancel)
    } else {
        join_rendezvous(cfg, num_ps, own_port, deadline, cancel)
    }
}

/// A buffer that [`io_loop`] fills from or drains into a socket.
pub(crate) enum IoBuf<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

/// Reads or writes the whole buffer, tolerating socket timeouts as long as progress is
/// made within `timeout`, giving up early when the other direction `failed` or when a
/// termination was requested and the peer has been silent for a grace period.
pub(crate) fn io_loop(
    mut stream: &TcpStream,
    buf: &mut IoBuf<'_>,
    timeout: Duration,
    cancel: &AtomicBool,
    failed: &AtomicU8,
) -> Result<()> {
    let total = match buf {
        IoBuf::Read(b) => b.len(),
        IoBuf::Write(b) => b.len(),
    };
    let mut done = 0;
    let mut last_progress = Instant::now();
    while done < total {
        let r = match buf {
            IoBuf::Read(b) => stream.read(&mut b[done..]),
            IoBuf::Write(b) => stream.write(&b[done..]),
        };
        match r {
            Ok(0) if failed.load(Ordering::SeqCst) != 0 => {
                bail!("the other direction of the exchange failed")
            }
            Ok(0) => bail!("the peer closed the connection"),
            Ok(k) => {
                done += k;
                last_progress = Instant::now();
            }
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                let silent = last_progress.elapsed();
                if failed.load(Ordering::SeqCst) != 0 {
                    bail!("the other direction of the exchange failed");
                }
                if silent >= timeout {
                    bail!("no progress for {} s (timeout)", timeout.as_secs_f64());
                }
                if cancel.load(Ordering::SeqCst) && silent >= TERMINATION_GRACE {
                    return Err(Interrupted.into());
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub(crate) fn check_cancel(cancel: &AtomicBool) -> Result<()> {
    if cancel.load(Ordering::SeqCst) {
        return Err(Interrupted.into());
    }
    Ok(())
}

fn bind_with_retry(port: u16, deadline: Instant, cancel: &AtomicBool) -> Result<TcpListener> {
    loop {
        match TcpListener::bind(("0.0.0.0", port)) {
            Ok(l) => return Ok(l),
            Err(e) => {
                check_cancel(cancel)?;
                if Instant::now() >= deadline {
                    return Err(e)
                        .with_context(|| format!("cannot bind the master port 0.0.0.0:{port}"));
                }
                eprintln!("rank 0: cannot bind master port {port} yet ({e}); retrying");
                thread::sleep(Duration::from_millis(500));
            }
        }
    }
}

pub(crate) fn connect_with_retry(
    addr: SocketAddr,
    deadline: Instant,
    cancel: &AtomicBool,
) -> Result<TcpStream> {
    loop {
        check_cancel(cancel)?;
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(e).context("rendezvous timeout reached");
            }
            Err(_) => thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// Reads one newline-terminated line, waiting at most until `deadline`.
fn read_line(mut stream: &TcpStream, deadline: Instant, cancel: &AtomicBool) -> Result<String> {
    stream.set_read_timeout(Some(POLL))?;
    let mut line = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => bail!("connection closed before a full line arrived"),
            Ok(k) => {
                line.extend_from_slice(&buf[..k]);
                if let Some(end) = line.iter().position(|&b| b == b'\n') {
                    line.truncate(end);
                    return String::from_utf8(line).context("line is not UTF-8");
                }
                ensure!(line.len() < 1 << 20, "line longer than 1 MiB");
            }
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                check_cancel(cancel)?;
                ensure!(
                    Instant::now() < deadline,
                    "rendezvous timeout reached while waiting for a reply"
                );
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn send_line(mut stream: &TcpStream, value: &impl Serialize) -> Result<()> {
    let mut line = serde_json::to_vec(value)?;
    line.push(b'\n');
    stream.set_write_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(&line)?;
    Ok(())
}

/// Rank 0: waits for every other rank, checks them, and sends out the address list.
fn serve_rendezvous(
    cfg: &RingConfig,
    num_ps: usize,
    listener: TcpListener,
    ring_port: u16,
    deadline: Instant,
    cancel: &AtomicBool,
) -> Result<Vec<String>> {
    let w = cfg.world_size;
    eprintln!(
        "rank 0/{w}: rendezvous on port {} for generation {}, waiting for {} peer(s)",
        listener.local_addr()?.port(),
        cfg.generation,
        w - 1
    );
    listener.set_nonblocking(true)?;
    // Each joined rank has its connection to the master and its ring address here.
    let mut peers: Vec<Option<(TcpStream, SocketAddr)>> = (0..w).map(|_| None).collect();
    let mut joined = 0;
    let mut refused: Vec<String> = Vec::new();
    while joined < w - 1 {
        check_cancel(cancel)?;
        if Instant::now() >= deadline {
            let missing: Vec<String> = (1..w)
                .filter(|&k| peers[k].is_none())
                .map(|k| k.to_string())
                .collect();
            let mut msg = format!(
                "rendezvous timed out after {} s: rank(s) {} never joined",
                cfg.rendezvous_timeout.as_secs_f64(),
                missing.join(", ")
            );
            if !refused.is_empty() {
                msg.push_str(&format!("; refused: {}", refused.join("; ")));
            }
            bail!(msg);
        }
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(e).context("accepting a rendezvous connection"),
        };
        stream.set_nonblocking(false)?;
        let hello_deadline = deadline.min(Instant::now() + Duration::from_secs(10));
        let hello: Hello = match read_line(&stream, hello_deadline, cancel)
            .and_then(|l| serde_json::from_str(&l).context("malformed hello"))
        {
            Ok(h) => h,
            Err(e) => {
                if e.is::<Interrupted>() {
                    return Err(e);
                }
                eprintln!("rank 0/{w}: ignoring a bad rendezvous connection from {peer}: {e:#}");
                continue;
            }
        };
        let problem = if hello.world_size != w {
            Some(format!(
                "rank {} says the world size is {} but rank 0 has {w}",
                hello.rank, hello.world_size
            ))
        } else if hello.num_ps != num_ps {
            Some(format!(
                "rank {} runs with CONVERGE_NUM_PS={} but rank 0 has CONVERGE_NUM_PS={num_ps}",
                hello.rank, hello.num_ps
            ))
        } else if hello.generation != cfg.generation {
            Some(format!(
                "rank {} is in generation {} but rank 0 is in generation {}",
                hello.rank, hello.generation, cfg.generation
            ))
        } else if hello.rank == 0 || hello.rank >= w {
            Some(format!(
                "rank {} is not a valid peer rank for world size {w}",
                hello.rank
            ))
        } else if peers[hello.rank]
            .as_ref()
            .is_some_and(|(earlier, _)| !connection_closed(earlier))
        {
            Some(format!("rank {} joined twice", hello.rank))
        } else {
            None
        };
        if let Some(problem) = problem {
            eprintln!("rank 0/{w}: refusing {peer}: {problem}");
            let _ = send_line(
                &stream,
                &Reply {
                    ok: false,
                    error: Some(format!("rendezvous refused: {problem}")),
                    addresses: Vec::new(),
                },
            );
            refused.push(format!("{peer}: {problem}"));
            continue;
        }
        let ring_addr = SocketAddr::new(peer.ip(), hello.ring_port);
        let role = if num_ps == 0 {
            format!("ring address {ring_addr}")
        } else if hello.rank >= w - num_ps {
            format!(
                "parameter-server shard {} at {ring_addr}",
                hello.rank - (w - num_ps)
            )
        } else {
            "worker".to_string()
        };
        eprintln!(
            "rank 0/{w}: rank {} joined from {peer} ({role})",
            hello.rank
        );
        // A rank whose earlier connection has closed (its process restarted, or the
        // connection broke after it was registered, so it joins again) replaces that
        // registration; it was counted once already.
        if peers[hello.rank].replace((stream, ring_addr)).is_some() {
            eprintln!(
                "rank 0/{w}: rank {} joined again; its earlier connection had closed",
                hello.rank
            );
        } else {
            joined += 1;
        }
        if joined == w - 1 {
            // Before the list goes out, a rank whose connection has closed since it joined
            // (its process died) is waited for again rather than sent a list it cannot read.
            for (k, slot) in peers.iter_mut().enumerate() {
                if slot.as_ref().is_some_and(|(s, _)| connection_closed(s)) {
                    eprintln!(
                        "rank 0/{w}: rank {k} left before the rendezvous completed; waiting for it again"
                    );
                    *slot = None;
                    joined -= 1;
                }
            }
        }
    }
    // Every peer has joined, so only rank 0's own slot is empty.
    let joined: Vec<(TcpStream, SocketAddr)> = peers.into_iter().flatten().collect();
    // Rank 0 never connects to its own entry; peers get the local address of their own
    // master connection instead, which they can reach by construction.
    let mut addresses =
        vec![SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), ring_port).to_string()];
    addresses.extend(joined.iter().map(|(_, a)| a.to_string()));
    for (k, (stream, _)) in joined.iter().enumerate().map(|(i, p)| (i + 1, p)) {
        let mut theirs = addresses.clone();
        theirs[0] = SocketAddr::new(stream.local_addr()?.ip(), ring_port).to_string();
        send_line(
            stream,
            &Reply {
                ok: true,
                error: None,
                addresses: theirs,
            },
        )
        .with_context(|| format!("cannot send the address list to rank {k}"))?;
    }
    let own = addresses;
    Ok(own)
}

/// Whether the peer has closed `stream` or it has failed: a peek that returns end of file
/// or an error other than "nothing to read yet". Data waiting to be read means open. Leaves
/// the stream blocking.
fn connection_closed(stream: &TcpStream) -> bool {
    if stream.set_nonblocking(true).is_err() {
        return true;
    }
    let closed = match stream.peek(&mut [0u8; 1]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted),
    };
    stream.set_nonblocking(false).is_err() || closed
}

/// Ranks other than 0: joins the master and receives the address list.
fn join_rendezvous(
    cfg: &RingConfig,
    num_ps: usize,
    ring_port: u16,
    deadline: Instant,
    cancel: &AtomicBool,
) -> Result<Vec<String>> {
    let w = cfg.world_size;
    let target = format!("{}:{}", cfg.master_addr, cfg.master_port);
    eprintln!("rank {}/{w}: joining the rendezvous at {target}", cfg.rank);
    let mut last_err = String::new();
    let hello = Hello {
        rank: cfg.rank,
        world_size: w,
        generation: cfg.generation,
        ring_port,
        num_ps,
    };
    // Until the deadline, an exchange whose connection is closed or reset before the reply
    // is tried again on a new connection: whatever held the master port before rank 0
    // bound it may have accepted this rank's first connection and dropped it. A reply,
    // even a refusal or one that is not JSON, is final.
    let line = loop {
        let stream = connect_master(cfg, &target, deadline, cancel, &mut last_err)?;
        match send_line(&stream, &hello).and_then(|()| read_line(&stream, deadline, cancel)) {
            Ok(line) => break line,
            Err(e) if e.is::<Interrupted>() => return Err(e),
            Err(e) if Instant::now() < deadline => {
                eprintln!(
                    "rank {}/{w}: rendezvous exchange with {target} failed ({e:#}); retrying",
                    cfg.rank
                );
                last_err = format!("{e:#}");
                thread::sleep(Duration::from_millis(200));
            }
            Err(e) => {
                return Err(e).with_context(|| format!("no answer from the master at {target}"));
            }
        }
    };
    let reply: Reply = serde_json::from_str(&line).context("malformed reply from the master")?;
    if !reply.ok {
        bail!(
            "{}",
            reply
                .error
                .unwrap_or_else(|| "the master refused this rank".to_string())
        );
    }
    ensure!(
        reply.addresses.len() == w,
        "the master sent {} addresses for world size {w}",
        reply.addresses.len()
    );
    Ok(reply.addresses)
}

/// Connects to the master at `target`, retrying until `deadline`; `last_err` keeps the
/// last failure for the timeout's message.
fn connect_master(
    cfg: &RingConfig,
    target: &str,
    deadline: Instant,
    cancel: &AtomicBool,
    last_err: &mut String,
) -> Result<TcpStream> {
    loop {
        check_cancel(cancel)?;
        if Instant::now() >= deadline {
            bail!(
                "rendezvous timed out after {} s: cannot reach the master at {target} ({last_err})",
                cfg.rendezvous_timeout.as_secs_f64()
            );
        }
        let addrs = match (cfg.master_addr.as_str(), cfg.master_port).to_socket_addrs() {
            Ok(a) => a.collect::<Vec<_>>(),
            Err(e) => {
                *last_err = format!("cannot resolve {}: {e}", cfg.master_addr);
                thread::sleep(Duration::from_millis(500));
                continue;
            }
        };
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                Ok(s) => return Ok(s),
                Err(e) => *last_err = format!("{a}: {e}"),
            }
        }
        thread::sleep(Duration::from_millis(200));
    }
}

/// Accepts the connection from the previous rank, dropping anything else.
fn accept_prev(
    listener: &TcpListener,
    prev_rank: usize,
    generation: u64,
    deadline: Instant,
    cancel: &AtomicBool,
) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    loop {
        check_cancel(cancel)?;
        if Instant::now() >= deadline {
            bail!("rendezvous timed out waiting for rank {prev_rank} to connect to the ring");
        }
        let (mut stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => return Err(e).context("accepting a ring connection"),
        };
        stream.set_nonblocking(false)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut hs = [0u8; 16];
        if let Err(e) = stream.read_exact(&mut hs) {
            eprintln!("ignoring a ring connection from {peer}: {e}");
            continue;
        }
        let rank = u32::from_le_bytes(hs[4..8].try_into()?) as usize;
        let gen_ = u64::from_le_bytes(hs[8..16].try_into()?);
        if &hs[..4] != RING_MAGIC || rank != prev_rank || gen_ != generation {
            eprintln!(
                "ignoring a ring connection from {peer}: not rank {prev_rank} of generation {generation}"
            );
            continue;
        }
        return Ok(stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(rank: usize, world_size: usize, port: u16, generation: u64) -> RingConfig {
        RingConfig {
            rank,
            world_size,
            generation,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            rendezvous_timeout: Duration::from_secs(20),
            io_timeout: Duration::from_secs(20),
        }
    }

    /// A ring-mode hello, as a joining rank sends it.
    fn hello(rank: usize, world_size: usize, generation: u64, ring_port: u16) -> Hello {
        Hello {
            rank,
            world_size,
            generation,
            ring_port,
            num_ps: 0,
        }
    }

    /// Runs `world` ranks in threads; each contributes `input(rank)` and all results are
    /// returned in rank order.
    fn run_ring(world: usize, input: impl Fn(usize) -> Vec<f64> + Sync) -> Vec<Vec<f64>> {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let mut master = Some(master);
        let input = &input;
        thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|r| {
                    let listener = if r == 0 { master.take() } else { None };
                    s.spawn(move || {
                        let cancel = Arc::new(AtomicBool::new(false));
                        let mut ring = Ring::connect_with_listener(
                            &config(r, world, port, 4),
                            listener,
                            cancel,
                        )
                        .unwrap();
                        let mut data = input(r);
                        // Two all-reduces in a row exercise the sequence numbers.
                        ring.all_reduce_sum(&mut data).unwrap();
                        let mut again = input(r);
                        ring.all_reduce_sum(&mut again).unwrap();
                        assert_eq!(again, data);
                        data
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn check_exact_sum(world: usize, len: usize) {
        let input = |r: usize| -> Vec<f64> {
            (0..len)
                .map(|i| ((r + 1) * 1000 + i) as f64 * 0.5)
                .collect()
        };
        let expected: Vec<f64> = (0..len)
            .map(|i| (0..world).map(|r| ((r + 1) * 1000 + i) as f64 * 0.5).sum())
            .collect();
        let results = run_ring(world, input);
        assert_eq!(results.len(), world);
        for (r, got) in results.iter().enumerate() {
            assert_eq!(got, &expected, "rank {r} of {world}, length {len}");
        }
    }

    #[test]
    fn three_ranks_get_the_exact_sum() {
        check_exact_sum(3, 1000);
    }

    #[test]
    fn four_ranks_get_the_exact_sum_of_a_large_vector() {
        // The vector is larger than socket buffers, so a blocking send-then-receive would
        // deadlock.
        check_exact_sum(4, 300_000);
    }

    #[test]
    fn two_ranks_with_lengths_not_divisible_or_below_world_size() {
        check_exact_sum(2, 7);
        check_exact_sum(2, 1);
        check_exact_sum(3, 2);
    }

    #[test]
    fn results_are_bit_identical_on_every_rank() {
        // These values have sums that depend on the order of addition.
        let input = |r: usize| -> Vec<f64> {
            (0..101)
                .map(|i| 0.1 * (i as f64 + 1.0) / (r as f64 + 3.0))
                .collect()
        };
        let results = run_ring(4, input);
        for got in &results[1..] {
            let a: Vec<u64> = got.iter().map(|v| v.to_bits()).collect();
            let b: Vec<u64> = results[0].iter().map(|v| v.to_bits()).collect();
            assert_eq!(a, b);
        }
    }

    #[test]
    fn a_rank_of_another_generation_is_refused() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let cancel = Arc::new(AtomicBool::new(false));
        let stale = {
            let cancel = cancel.clone();
            thread::spawn(move || Ring::connect(&config(1, 2, port, 6), cancel))
        };
        let mut rank0 = config(0, 2, port, 7);
        rank0.rendezvous_timeout = Duration::from_secs(2);
        let err = Ring::connect_with_listener(&rank0, Some(master), cancel).unwrap_err();
        assert!(format!("{err:#}").contains("never joined"), "{err:#}");
        let err = stale.join().unwrap().unwrap_err();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("generation 6") && msg.contains("generation 7"),
            "{msg}"
        );
    }

    #[test]
    fn a_peer_that_disappears_is_reported() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let peer = thread::spawn(move || {
            let cancel = Arc::new(AtomicBool::new(false));
            let ring = Ring::connect(&config(1, 2, port, 1), cancel).unwrap();
            drop(ring);
        });
        let cancel = Arc::new(AtomicBool::new(false));
        let mut ring =
            Ring::connect_with_listener(&config(0, 2, port, 1), Some(master), cancel).unwrap();
        peer.join().unwrap();
        let mut data = vec![1.0; 10];
        assert!(ring.all_reduce_sum(&mut data).is_err());
    }

    /// Whatever held the master port first accepted rank 1's connection and dropped it
    /// before any reply: rank 1 connects again and joins the real master once it binds
    /// the port.
    #[test]
    fn a_connection_dropped_before_the_reply_is_tried_again() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let rank0 = thread::spawn(move || {
            let (first, _) = master.accept().unwrap();
            drop(first);
            let cancel = Arc::new(AtomicBool::new(false));
            let mut ring =
                Ring::connect_with_listener(&config(0, 2, port, 3), Some(master), cancel).unwrap();
            let mut data = vec![1.0, 2.0];
            ring.all_reduce_sum(&mut data).unwrap();
            data
        });
        let cancel = Arc::new(AtomicBool::new(false));
        let mut ring = Ring::connect(&config(1, 2, port, 3), cancel).unwrap();
        let mut data = vec![10.0, 20.0];
        ring.all_reduce_sum(&mut data).unwrap();
        assert_eq!(data, vec![11.0, 22.0]);
        assert_eq!(rank0.join().unwrap(), vec![11.0, 22.0]);
    }

    /// Rank 1 joins and its process dies before the address list is sent; restarted, it
    /// joins again, and the master takes the new connection in place of the closed one
    /// instead of refusing it as a rank that joined twice.
    #[test]
    fn a_rank_that_joins_again_after_its_connection_closed_replaces_it() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let rank0 = thread::spawn(move || {
            let cancel = Arc::new(AtomicBool::new(false));
            let mut ring =
                Ring::connect_with_listener(&config(0, 3, port, 2), Some(master), cancel).unwrap();
            let mut data = vec![1.0];
            ring.all_reduce_sum(&mut data).unwrap();
            data
        });
        // The first rank 1: registers, then closes its connection without a reply.
        let first = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let ring_port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        send_line(&first, &hello(1, 3, 2, ring_port)).unwrap();
        // A short wait lets rank 0 register this rank before its connection closes (the
        // case under test); had it not yet read the hello, it would register and then drop
        // the closed connection before the list goes out, with the same outcome.
        thread::sleep(Duration::from_millis(300));
        drop(first);
        thread::sleep(Duration::from_millis(100));
        let peers: Vec<_> = [1, 2]
            .into_iter()
            .map(|r| {
                thread::spawn(move || {
                    let cancel = Arc::new(AtomicBool::new(false));
                    let mut ring = Ring::connect(&config(r, 3, port, 2), cancel).unwrap();
                    let mut data = vec![10.0 * r as f64];
                    ring.all_reduce_sum(&mut data).unwrap();
                    data
                })
            })
            .collect();
        for p in peers {
            assert_eq!(p.join().unwrap(), vec![31.0]);
        }
        assert_eq!(rank0.join().unwrap(), vec![31.0]);
    }

    #[test]
    fn a_closed_connection_is_told_from_an_open_one() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        assert!(!connection_closed(&server), "open, nothing sent");
        client.write_all(b"more").unwrap();
        thread::sleep(Duration::from_millis(50));
        assert!(!connection_closed(&server), "open, bytes waiting");
        // The check leaves the stream blocking: this read waits for and gets the bytes.
        let mut buf = [0u8; 4];
        (&server).read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"more");
        drop(client);
        thread::sleep(Duration::from_millis(50));
        assert!(connection_closed(&server), "closed by the peer");
    }

    /// A second hello for a rank whose first connection is still open is refused, and the
    /// first one completes the rendezvous.
    #[test]
    fn a_rank_that_joins_twice_on_open_connections_is_refused() {
        let master = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = master.local_addr().unwrap().port();
        let rank0 = thread::spawn(move || {
            let cancel = AtomicBool::new(false);
            rendezvous(&config(0, 3, port, 5), 0, Some(master), 1, &cancel)
        });
        let first = TcpStream::connect(("127.0.0.1", port)).unwrap();
        send_line(&first, &hello(1, 3, 5, 2)).unwrap();
        thread::sleep(Duration::from_millis(300));
        let second = TcpStream::connect(("127.0.0.1", port)).unwrap();
        send_line(&second, &hello(1, 3, 5, 2)).unwrap();
        let cancel = AtomicBool::new(false);
        let deadline = Instant::now() + Duration::from_secs(10);
        let refusal: Reply =
            serde_json::from_str(&read_line(&second, deadline, &cancel).unwrap()).unwrap();
        assert!(!refusal.ok);
        assert!(
            refusal
                .error
                .as_deref()
                .unwrap_or("")
                .contains("joined twice"),
            "{refusal:?}"
        );
        let third = TcpStream::connect(("127.0.0.1", port)).unwrap();
        send_line(&third, &hello(2, 3, 5, 2)).unwrap();
        let reply: Reply =
            serde_json::from_str(&read_line(&first, deadline, &cancel).unwrap()).unwrap();
        assert!(reply.ok && reply.addresses.len() == 3, "{reply:?}");
        assert_eq!(rank0.join().unwrap().unwrap().len(), 3);
    }

    #[test]
    fn termination_during_rendezvous_interrupts() {
        let cancel = Arc::new(AtomicBool::new(true));
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let err = Ring::connect(&config(1, 2, port, 1), cancel).unwrap_err();
        assert!(err.is::<Interrupted>());
    }
}
