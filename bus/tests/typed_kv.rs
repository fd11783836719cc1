//! A bucket followed as typed changes ([`follow_kv_typed`]) against a real `nats-server`
//! (one server, JetStream, a dynamic port): the values at start, then changes and a
//! deletion, arrive typed; a malformed value and a bad key are counted in `Rejects`,
//! refused, and the follower goes on.
//!
//! Needs `nats-server` (2.10+) on PATH or in `NATS_SERVER_BIN`; skipped with a message
//! when there is none, unless `CONVERGE_REQUIRE_NATS=1`.

mod support;
use converge_bus::{
    Bus, KvChange, KvDecoder, KvStore, QueueBuckets, Rejects, Setup, follow_kv_typed,
};
use converge_common::{QueueId, QueueSpec, encode};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;
use support::nats_server_bin;
use tokio::sync::mpsc;

/// One JetStream server on a free port, its store in a temporary directory; killed (and
/// the directory removed) on drop.
struct Server {
    child: Child,
    dir: PathBuf,
    url: String,
}

impl Server {
    fn start(bin: &PathBuf) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir =
            std::env::temp_dir().join(format!("converge-bus-typed-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let child = Command::new(bin)
            .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
            .arg(&dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        Self {
            child,
            dir,
            url: format!("nats://127.0.0.1:{port}"),
        }
    }

    async fn bus(&self) -> Bus {
        for _ in 0..100 {
            if let Ok(client) = async_nats::connect(&self.url).await {
                return Bus::open(client).await.expect("open the buckets");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("nats-server at {} did not answer", self.url);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn queue(name: &str, quota_gpus: u32) -> QueueSpec {
    QueueSpec {
        name: name.parse().unwrap(),
        quota_gpus,
        ..QueueSpec::implicit_default()
    }
}

/// Follows a queues bucket as typed changes: its refusal counts, the changes, the task.
fn follow_queues(
    store: async_nats::jetstream::kv::Store,
) -> (
    Arc<Rejects>,
    mpsc::Receiver<KvChange<QueueId, QueueSpec>>,
    tokio::task::JoinHandle<()>,
) {
    let rejects = Arc::new(Rejects::default());
    let decoder = KvDecoder::named(rejects.clone(), |q: &QueueSpec| &q.name);
    let (tx, rx) = mpsc::channel(64);
    let follower = tokio::spawn(follow_kv_typed(store, decoder, tx, |c| c));
    (rejects, rx, follower)
}

async fn next<T>(rx: &mut mpsc::Receiver<T>) -> T {
    tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("a change within 10 s")
        .expect("the follower is running")
}

/// A server (kept alive by the first element), its bus and the queue buckets; `None`
/// (the test is skipped) without a nats-server binary.
async fn started() -> Option<(Server, Bus, QueueBuckets)> {
    let server = Server::start(&nats_server_bin()?);
    let bus = server.bus().await;
    let queues = bus.open_queues(Setup::CreateOrUpdate).await.unwrap();
    Some((server, bus, queues))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_followed_as_typed_changes() {
    let Some((_server, bus, queues)) = started().await else {
        return;
    };
    let store = queues.queues.clone();
    // At start: two queues, a malformed value, a queue stored under another's name, and a
    // key that is no queue name.
    store.put("a", encode(&queue("a", 1)).into()).await.unwrap();
    store.put("b", encode(&queue("b", 2)).into()).await.unwrap();
    store.put("c", "{not json".into()).await.unwrap();
    store.put("d", encode(&queue("a", 9)).into()).await.unwrap();
    store
        .put("x=y", encode(&queue("a", 9)).into())
        .await
        .unwrap();

    // Opened again (the follower asks the server whether the bucket is empty; the store's
    // information as opened may be out of date, see the next test).
    let store = bus.js.get_key_value("converge-queues").await.unwrap();
    let (rejects, mut rx, follower) = follow_queues(store.clone());
    let id = |s: &str| s.parse::<QueueId>().unwrap();

    let mut changes = Vec::new();
    let mut current = KvStore::new();
    while !current.is_caught_up() {
        let change: KvChange<QueueId, QueueSpec> = next(&mut rx).await;
        changes.push(change.clone());
        current.apply(change);
    }
    assert_eq!(changes.len(), 6, "{changes:?}");
    assert_eq!(changes[0], KvChange::Put(id("a"), queue("a", 1)));
    assert_eq!(changes[1], KvChange::Put(id("b"), queue("b", 2)));
    assert!(
        matches!(&changes[2], KvChange::Refused { key, .. } if *key == id("c")),
        "{:?}",
        changes[2]
    );
    assert_eq!(
        changes[3],
        KvChange::Refused {
            key: id("d"),
            reason: "value of a stored under d".into()
        }
    );
    assert!(
        matches!(&changes[4], KvChange::BadKey { key, .. } if key == "x=y"),
        "{:?}",
        changes[4]
    );
    assert_eq!(changes[5], KvChange::CaughtUp);
    assert_eq!(
        current
            .iter()
            .map(|(k, v)| (k.as_str(), v.quota_gpus))
            .collect::<Vec<_>>(),
        [("a", 1), ("b", 2)]
    );
    let counts = rejects.snapshot();
    assert_eq!(
        counts
            .keys()
            .map(|(s, k)| (s.as_str(), *k))
            .collect::<Vec<_>>(),
        [
            ("kv:converge-queues", "bad_key"),
            ("kv:converge-queues", "malformed")
        ]
    );
    assert_eq!(
        rejects.total(),
        2,
        "a value under another key is refused, not counted"
    );

    // Then changes: a new value, a deletion, a malformed value that leaves the last valid
    // one, and the follower still going after it.
    store.put("a", encode(&queue("a", 5)).into()).await.unwrap();
    store.delete("b").await.unwrap();
    store.put("a", "garbage".into()).await.unwrap();
    store.put("e", encode(&queue("e", 3)).into()).await.unwrap();
    let mut after = Vec::new();
    for _ in 0..4 {
        let change = next(&mut rx).await;
        after.push(change.clone());
        current.apply(change);
    }
    assert_eq!(after[0], KvChange::Put(id("a"), queue("a", 5)));
    assert_eq!(after[1], KvChange::Deleted(id("b")));
    assert!(
        matches!(&after[2], KvChange::Refused { key, .. } if *key == id("a")),
        "{:?}",
        after[2]
    );
    assert_eq!(after[3], KvChange::Put(id("e"), queue("e", 3)));
    assert_eq!(
        current
            .iter()
            .map(|(k, v)| (k.as_str(), v.quota_gpus))
            .collect::<Vec<_>>(),
        [("a", 5), ("e", 3)]
    );
    assert_eq!(rejects.total(), 3);
    assert!(!follower.is_finished());
    // The follower ends when its receiver is gone.
    drop(rx);
    store.put("e", encode(&queue("e", 4)).into()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), follower)
        .await
        .expect("the follower ends")
        .unwrap();
}

/// A bucket that held values when it was opened but is empty when followed (its values
/// expired or were purged in between): the follower still says it has caught up, within
/// a few seconds, instead of waiting for the next write. The allocator takes no step
/// before its specs and heartbeats have caught up, so without this it would wait, with
/// no agent writing, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucket_emptied_after_it_was_opened_is_caught_up() {
    let Some((_server, bus, queues)) = started().await else {
        return;
    };
    queues
        .queues
        .put("a", encode(&queue("a", 1)).into())
        .await
        .unwrap();
    // Opened with one value in its stream information...
    let store = bus.js.get_key_value("converge-queues").await.unwrap();
    assert_eq!(store.status().await.unwrap().values(), 1);
    // ...then emptied.
    let stream = bus.js.get_stream("KV_converge-queues").await.unwrap();
    stream.purge().await.unwrap();
    assert_eq!(stream.get_info().await.unwrap().state.messages, 0);

    let (rejects, mut rx, follower) = follow_queues(store);
    let first: KvChange<QueueId, QueueSpec> = next(&mut rx).await;
    assert_eq!(first, KvChange::CaughtUp);
    // Then changes as ever.
    queues
        .queues
        .put("b", encode(&queue("b", 2)).into())
        .await
        .unwrap();
    let change: KvChange<QueueId, QueueSpec> = next(&mut rx).await;
    assert_eq!(change, KvChange::Put("b".parse().unwrap(), queue("b", 2)));
    assert_eq!(rejects.total(), 0);
    drop(rx);
    follower.abort();
}
