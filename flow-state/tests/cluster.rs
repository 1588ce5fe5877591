//! Cluster mode against the real ZooKeeper of scripts/cluster.sh (127.0.0.1:12181): membership,
//! the members watch, partition leases and generations. Each test works under its own root
//! (`/flow-test/<test>-<pid>-<nanos>`) and deletes it at the end.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use flow_state::cluster::{
    Cluster, ClusterError, ClusterUrl, OwnerStatus, Ownership, SessionStatus,
};
use tokio::sync::watch;
use zookeeper_client as zk;

const ZOOKEEPER: &str = "127.0.0.1:12181";
/// The shortest timeout the test server grants (2 ticks of 2 s): a lost session shows soonest.
const SESSION_TIMEOUT: Duration = Duration::from_secs(4);
/// How long a test waits for something ZooKeeper should do at once.
const PROMPTLY: Duration = Duration::from_secs(5);
const PIPELINE: &str = "orders";

/// A unique root for one test, removed (with everything under it) by [`Root::remove`].
struct Root {
    url: ClusterUrl,
}

impl Root {
    fn new(test: &str) -> Result<Root> {
        let nanos = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
        let url = format!(
            "zk://{ZOOKEEPER}/flow-test/{test}-{}-{nanos}",
            std::process::id()
        );
        Ok(Root { url: url.parse()? })
    }

    async fn worker(&self, id: &str) -> Result<Cluster> {
        Ok(Cluster::connect(&self.url, id, SESSION_TIMEOUT).await?)
    }

    async fn remove(self) -> Result<()> {
        let client = zk::Client::connect(ZOOKEEPER).await?;
        delete_tree(&client, self.url.root().to_owned()).await
    }
}

async fn delete_tree(client: &zk::Client, path: String) -> Result<()> {
    let children = match client.list_children(&path).await {
        Ok(children) => children,
        Err(zk::Error::NoNode) => return Ok(()),
        Err(error) => return Err(error).context(format!("list {path}")),
    };
    for child in children {
        Box::pin(delete_tree(client, format!("{path}/{child}"))).await?;
    }
    match client.delete(&path, None).await {
        Ok(()) | Err(zk::Error::NoNode) => Ok(()),
        Err(error) => Err(error).context(format!("delete {path}")),
    }
}

/// Waits until the watched value satisfies `done`, at most [`PROMPTLY`].
async fn wait_until<T>(
    receiver: &mut watch::Receiver<T>,
    what: &str,
    done: impl FnMut(&T) -> bool,
) -> Result<()> {
    match tokio::time::timeout(PROMPTLY, receiver.wait_for(done)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(_)) => bail!("the watch of {what} ended"),
        Err(_) => bail!("{what} did not happen within {PROMPTLY:?}"),
    }
}

fn set(ids: &[&str]) -> BTreeSet<String> {
    ids.iter().map(|id| id.to_string()).collect()
}

/// Starts `worker`'s acquire of partition 3 and checks that it is still waiting after a while.
async fn acquire_in_background(
    worker: Arc<Cluster>,
) -> Result<tokio::task::JoinHandle<Result<Option<Ownership>, ClusterError>>> {
    let waiting = tokio::spawn(async move {
        worker
            .acquire(PIPELINE, 3, std::future::pending::<()>())
            .await
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    if waiting.is_finished() {
        bail!("the second acquire did not wait while the first worker held the lease");
    }
    Ok(waiting)
}

/// Acquires without a cancel; `None` (cancelled) cannot happen.
async fn take(worker: &Cluster, partition: u32) -> Result<Ownership> {
    worker
        .acquire(PIPELINE, partition, std::future::pending::<()>())
        .await?
        .context("an acquire without a cancel was cancelled")
}

fn owner(worker_id: &str, generation: i32, lease_holder: Option<&str>) -> OwnerStatus {
    OwnerStatus {
        worker_id: worker_id.into(),
        generation,
        lease_holder: lease_holder.map(Into::into),
    }
}

/// Two workers of one root, the first holding partition 3.
struct Contest {
    root: Root,
    first: Cluster,
    second: Arc<Cluster>,
    held: Ownership,
}

/// `first_url`: where the first worker reaches ZooKeeper (a [`Proxy`]'s URL), or `None` for the
/// root's own.
async fn contest(test: &str, first_url: Option<&Proxy>) -> Result<Contest> {
    let root = Root::new(test)?;
    let first = match first_url {
        Some(proxy) => Cluster::connect(&proxy.url(&root)?, "w1", SESSION_TIMEOUT).await?,
        None => root.worker("w1").await?,
    };
    let second = Arc::new(root.worker("w2").await?);
    let held = take(&first, 3).await?;
    Ok(Contest {
        root,
        first,
        second,
        held,
    })
}

/// The second acquire's result, within `within`.
async fn taken(
    waiting: tokio::task::JoinHandle<Result<Option<Ownership>, ClusterError>>,
    within: Duration,
) -> Result<Ownership> {
    let taken = tokio::time::timeout(within, waiting)
        .await
        .context("the second acquire is still waiting")???;
    taken.context("the second acquire was cancelled")
}

#[tokio::test]
async fn a_second_acquire_waits_until_the_first_releases_and_gets_the_next_generation() -> Result<()>
{
    let Contest {
        root,
        first,
        second,
        held,
    } = contest("release", None).await?;
    assert_eq!(held.generation, 1);
    assert_eq!(held.partition, 3);
    assert_eq!(
        held.owner_path,
        format!("{}/{PIPELINE}/partitions/3/owner", root.url.root())
    );
    let waiting = acquire_in_background(second.clone()).await?;
    assert!(first.release(&held).await?);
    let next = taken(waiting, PROMPTLY).await?;
    assert_eq!(next.generation, 2);
    assert_eq!(
        second.owners(PIPELINE).await?.get(&3),
        Some(&owner("w2", 2, Some("w2")))
    );
    // The old owner's release no longer deletes anything: the lease is the new owner's.
    assert!(!first.release(&held).await?);
    assert!(second.release(&next).await?);
    assert_eq!(
        second.owners(PIPELINE).await?.get(&3),
        Some(&owner("w2", 2, None))
    );
    drop((first, second));
    root.remove().await
}

#[tokio::test]
async fn a_second_acquire_waits_until_the_first_session_is_closed() -> Result<()> {
    let Contest {
        root,
        first,
        second,
        held,
    } = contest("closed", None).await?;
    // Acquiring again in the same session returns the lease as it is.
    assert_eq!(take(&first, 3).await?, held);
    let waiting = acquire_in_background(second.clone()).await?;
    let status = first.session_status();
    first.close().await;
    assert_eq!(*status.borrow(), SessionStatus::Closed);
    assert_eq!(
        taken(waiting, PROMPTLY).await?.generation,
        held.generation + 1
    );
    drop(second);
    root.remove().await
}

#[tokio::test]
async fn a_second_acquire_waits_until_the_first_session_expires() -> Result<()> {
    let proxy = Proxy::start()?;
    let Contest {
        root,
        first,
        second,
        held,
    } = contest("expired", Some(&proxy)).await?;
    let waiting = acquire_in_background(second.clone()).await?;
    // The first worker loses ZooKeeper for good: the server expires its session after the
    // session timeout, which deletes its lease, and its client gives up reconnecting.
    let mut status = first.session_status();
    proxy.set_down(true);
    let expiry = SESSION_TIMEOUT * 3;
    let next = taken(waiting, expiry).await?;
    assert_eq!(next.generation, held.generation + 1);
    tokio::time::timeout(expiry, status.wait_for(|s| *s == SessionStatus::Expired))
        .await
        .context("the first session did not expire")?
        .ok()
        .context("the first session's status ended before Expired")?;
    // The zombie's own requests are refused; its release deletes nothing.
    let refused = first.release(&held).await.err().map(|e| e.to_string());
    assert_eq!(
        refused.as_deref(),
        Some(format!("the ZooKeeper session of worker \"w1\" ended (Expired) during stat of {}: its member node and leases are gone; connect and join again", held.lease_path).as_str())
    );
    drop((first, second));
    root.remove().await
}

#[tokio::test]
async fn a_waiting_acquire_is_cancelled_and_takes_nothing() -> Result<()> {
    let root = Root::new("cancel")?;
    let first = root.worker("w1").await?;
    let second = root.worker("w2").await?;
    let held = take(&first, 0).await?;
    let cancelled = tokio::time::timeout(
        PROMPTLY,
        second.acquire(PIPELINE, 0, tokio::time::sleep(Duration::from_millis(300))),
    )
    .await
    .context("the cancel did not end the wait")??;
    assert_eq!(cancelled, None);
    assert_eq!(
        second.owners(PIPELINE).await?.get(&0),
        Some(&owner("w1", held.generation, Some("w1")))
    );
    drop((first, second));
    root.remove().await
}

#[tokio::test]
async fn the_members_watch_sees_a_join_and_a_leave() -> Result<()> {
    let root = Root::new("members")?;
    let first = root.worker("w1").await?;
    first.join(PIPELINE).await?;
    let mut members = first.members(PIPELINE).await?;
    assert_eq!(*members.borrow_and_update(), set(&["w1"]));

    let second = root.worker("w2").await?;
    second.join(PIPELINE).await?;
    wait_until(&mut members, "w2's join", |m| *m == set(&["w1", "w2"])).await?;

    let third = root.worker("w3").await?;
    third.join(PIPELINE).await?;
    wait_until(&mut members, "w3's join", |m| {
        *m == set(&["w1", "w2", "w3"])
    })
    .await?;
    // An orderly leave, then a session's end.
    second.leave(PIPELINE).await?;
    wait_until(&mut members, "w2's leave", |m| *m == set(&["w1", "w3"])).await?;
    third.close().await;
    wait_until(&mut members, "w3's session end", |m| *m == set(&["w1"])).await?;
    drop((first, second));
    root.remove().await
}

#[tokio::test]
async fn a_duplicate_live_member_id_is_refused() -> Result<()> {
    let root = Root::new("duplicate")?;
    let first = root.worker("w1").await?;
    first.join(PIPELINE).await?;
    // Joining again in the same session is fine.
    first.join(PIPELINE).await?;
    let impostor = root.worker("w1").await?;
    let refused = impostor.join(PIPELINE).await.err().map(|e| e.to_string());
    assert_eq!(
        refused.as_deref(),
        Some(format!("worker id \"w1\" is already a live member of pipeline \"orders\" ({}/orders/members/w1 is held by another ZooKeeper session): give each worker its own id; if that worker was just stopped, its session ends within its timeout ({:?} for this worker's session) and the id is free again", root.url.root(), impostor.session_timeout()).as_str())
    );
    // Once the holder's session is gone, the id is free.
    first.close().await;
    impostor.join(PIPELINE).await?;
    drop(impostor);
    root.remove().await
}

#[tokio::test]
async fn bad_names_and_an_unreachable_server_are_refused() -> Result<()> {
    let url: ClusterUrl = "zk://127.0.0.1:1/flow".parse()?;
    let refused = Cluster::connect(&url, "w/1", SESSION_TIMEOUT)
        .await
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        refused.as_deref(),
        Some("invalid worker id \"w/1\" for cluster mode: it contains \"/\", which would make it a path of several ZooKeeper nodes")
    );
    let refused = Cluster::connect(&url, "w1", Duration::ZERO)
        .await
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        refused.as_deref(),
        Some("the ZooKeeper session timeout must be more than zero (the default is 10s); the server bounds it to 2 to 20 of its ticks")
    );
    let refused = Cluster::connect(&url, "w1", Duration::from_millis(500))
        .await
        .err()
        .map(|e| e.to_string());
    assert_eq!(
        refused.as_deref(),
        Some("cannot open a ZooKeeper session with zk://127.0.0.1:1/flow within 500ms: timeout. Check that ZooKeeper runs there and that this machine reaches it")
    );
    Ok(())
}

#[tokio::test]
async fn owners_refuse_a_node_flow_did_not_make_and_join_a_bad_pipeline_name() -> Result<()> {
    let root = Root::new("strays")?;
    let worker = root.worker("w1").await?;
    assert!(worker.owners(PIPELINE).await?.is_empty());
    take(&worker, 0).await?;
    let stray = format!("{}/{PIPELINE}/partitions/notes", root.url.root());
    let options = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
    worker.client().create(&stray, &[], &options).await?;
    let refused = worker.owners(PIPELINE).await.err().map(|e| e.to_string());
    assert_eq!(
        refused,
        Some(format!("unexpected node {stray} in the cluster state: the children of {}/{PIPELINE}/partitions are partition numbers. It was not made by flow; delete it", root.url.root()))
    );
    let refused = worker.join("..").await.err().map(|e| e.to_string());
    assert_eq!(
        refused.as_deref(),
        Some("invalid pipeline name \"..\" for cluster mode: ZooKeeper refuses \".\" and \"..\" as node names")
    );
    drop(worker);
    root.remove().await
}

/// A TCP proxy in front of ZooKeeper that can cut every connection and refuse new ones for a
/// while: a lost connection without touching the shared server.
struct Proxy {
    port: u16,
    state: std::sync::Arc<std::sync::Mutex<ProxyState>>,
}

#[derive(Default)]
struct ProxyState {
    down: bool,
    open: Vec<std::net::TcpStream>,
}

impl Proxy {
    fn start() -> Result<Proxy> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let state = std::sync::Arc::new(std::sync::Mutex::new(ProxyState::default()));
        let shared = state.clone();
        // The accept thread ends with the test process.
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(mut state) = shared.lock() else { return };
                if state.down {
                    continue;
                }
                let Ok(server) = std::net::TcpStream::connect(ZOOKEEPER) else {
                    continue;
                };
                for (from, to) in [(&client, &server), (&server, &client)] {
                    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
                        continue;
                    };
                    std::thread::spawn(move || {
                        let _ = std::io::copy(&mut from, &mut to);
                        let _ = to.shutdown(std::net::Shutdown::Both);
                    });
                }
                state.open.extend([client, server]);
            }
        });
        Ok(Proxy { port, state })
    }

    fn url(&self, root: &Root) -> Result<ClusterUrl> {
        Ok(format!("zk://127.0.0.1:{}{}", self.port, root.url.root()).parse()?)
    }

    /// Cuts every connection and refuses new ones (`true`), or lets them through again.
    fn set_down(&self, down: bool) {
        if let Ok(mut state) = self.state.lock() {
            state.down = down;
            for stream in state.open.drain(..) {
                let _ = stream.shutdown(std::net::Shutdown::Both);
            }
        }
    }
}

#[tokio::test]
async fn the_session_and_the_members_watch_live_through_a_lost_connection() -> Result<()> {
    let root = Root::new("reconnect")?;
    let proxy = Proxy::start()?;
    let first = Cluster::connect(&proxy.url(&root)?, "w1", SESSION_TIMEOUT).await?;
    first.join(PIPELINE).await?;
    let mut members = first.members(PIPELINE).await?;
    let mut status = first.session_status();
    assert_eq!(*status.borrow_and_update(), SessionStatus::Connected);

    proxy.set_down(true);
    wait_until(&mut status, "the lost connection", |s| {
        *s == SessionStatus::Disconnected
    })
    .await?;
    // A member joins while the first worker cannot hear of it.
    let second = root.worker("w2").await?;
    second.join(PIPELINE).await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(*members.borrow(), set(&["w1"]));

    // Back within the session timeout: the same session, its member node, and the watch (armed
    // again by the client) reports the join it missed.
    proxy.set_down(false);
    wait_until(&mut status, "the reconnection", |s| {
        *s == SessionStatus::Connected
    })
    .await?;
    wait_until(&mut members, "w2's join after the reconnection", |m| {
        *m == set(&["w1", "w2"])
    })
    .await?;
    second.leave(PIPELINE).await?;
    wait_until(&mut members, "w2's leave", |m| *m == set(&["w1"])).await?;
    drop((first, second));
    root.remove().await
}

#[test]
fn cluster_urls_parse_or_name_the_part_at_fault() {
    let good = [
        ("zk://127.0.0.1:2181/flow", "zk://127.0.0.1:2181/flow", 1),
        (
            "zk://a:1,b:2,c:3/flow/prod",
            "zk://a:1,b:2,c:3/flow/prod",
            3,
        ),
        ("zk://[::1]:2181/flow", "zk://[::1]:2181/flow", 1),
    ];
    for (url, shown, hosts) in good {
        let parsed: ClusterUrl = match url.parse() {
            Ok(parsed) => parsed,
            Err(error) => panic!("{url} refused: {error}"),
        };
        assert_eq!(parsed.to_string(), shown);
        assert_eq!(parsed.hosts().len(), hosts, "{url}");
    }
    let parsed: Result<ClusterUrl, _> = "zk://[::1]:2181/flow".parse();
    assert_eq!(
        parsed
            .ok()
            .map(|url| (url.hosts()[0].host.clone(), url.root().to_owned())),
        Some(("::1".to_owned(), "/flow".to_owned()))
    );
    let bad = [
        ("http://127.0.0.1:2181/flow", "bad cluster URL \"http://127.0.0.1:2181/flow\": it must start with zk:// (zk://HOST:PORT[,HOST:PORT]/PATH)"),
        ("127.0.0.1:2181/flow", "bad cluster URL \"127.0.0.1:2181/flow\": it must start with zk:// (zk://HOST:PORT[,HOST:PORT]/PATH)"),
        ("zk:///flow", "bad cluster URL \"zk:///flow\": no ZooKeeper host before the path (zk://HOST:PORT[,HOST:PORT]/PATH)"),
        ("zk://:2181/flow", "bad cluster URL \"zk://:2181/flow\": host 1 is empty (zk://HOST:PORT[,HOST:PORT]/PATH)"),
        ("zk://a:1,,b:2/flow", "bad cluster URL \"zk://a:1,,b:2/flow\": host 2 is empty (zk://HOST:PORT[,HOST:PORT]/PATH)"),
        ("zk://:/flow", "bad cluster URL \"zk://:/flow\": host 1 is empty (zk://HOST:PORT[,HOST:PORT]/PATH)"),
        ("zk://[::1]/flow", "bad cluster URL \"zk://[::1]/flow\": host \"[::1]\" has no port: write [::1]:PORT (ZooKeeper's client port is usually 2181)"),
        ("zk://a:1,/flow", "bad cluster URL \"zk://a:1,/flow\": host 2 is empty (zk://HOST:PORT[,HOST:PORT]/PATH)"),
        ("zk://a b:1/flow", "bad cluster URL \"zk://a b:1/flow\": host \"a b:1\" contains whitespace: write hosts as HOST:PORT separated by commas only"),
        ("zk://::1:2181/flow", "bad cluster URL \"zk://::1:2181/flow\": host \"::1:2181\" is an IPv6 address without brackets: write [ADDRESS]:PORT"),
        ("zk://[::1:2181/flow", "bad cluster URL \"zk://[::1:2181/flow\": host \"[::1:2181\" has no closing \"]\": write an IPv6 address as [ADDRESS]:PORT"),
        ("zk://localhost/flow", "bad cluster URL \"zk://localhost/flow\": host \"localhost\" has no port: write localhost:PORT (ZooKeeper's client port is usually 2181)"),
        ("zk://localhost:/flow", "bad cluster URL \"zk://localhost:/flow\": host \"localhost\" has no port: write localhost:PORT (ZooKeeper's client port is usually 2181)"),
        ("zk://localhost:http/flow", "bad cluster URL \"zk://localhost:http/flow\": the port \"http\" of host \"localhost\" is not a number from 1 to 65535"),
        ("zk://localhost:0/flow", "bad cluster URL \"zk://localhost:0/flow\": the port \"0\" of host \"localhost\" is not a number from 1 to 65535"),
        ("zk://localhost:65536/flow", "bad cluster URL \"zk://localhost:65536/flow\": the port \"65536\" of host \"localhost\" is not a number from 1 to 65535"),
        ("zk://localhost:+2181/flow", "bad cluster URL \"zk://localhost:+2181/flow\": the port \"+2181\" of host \"localhost\" is not a number from 1 to 65535"),
        ("zk://localhost:2181", "bad cluster URL \"zk://localhost:2181\": no path after the hosts: name the ZooKeeper node under which flow keeps its cluster state, e.g. zk://127.0.0.1:2181/flow"),
        ("zk://localhost:2181/", "bad cluster URL \"zk://localhost:2181/\": the path is ZooKeeper's root \"/\": name a node under it, e.g. /flow"),
        ("zk://localhost:2181/flow/", "bad cluster URL \"zk://localhost:2181/flow/\": the path \"/flow/\" ends with \"/\": write it without, e.g. \"/flow\""),
        ("zk://localhost:2181/flow//prod", "bad cluster URL \"zk://localhost:2181/flow//prod\": the path \"/flow//prod\" has an empty segment (\"//\")"),
        ("zk://localhost:2181/flow/../prod", "bad cluster URL \"zk://localhost:2181/flow/../prod\": the path \"/flow/../prod\" has the relative segment \"..\": ZooKeeper paths are absolute, without \".\" or \"..\""),
        ("zk://localhost:2181/./flow", "bad cluster URL \"zk://localhost:2181/./flow\": the path \"/./flow\" has the relative segment \".\": ZooKeeper paths are absolute, without \".\" or \"..\""),
        ("zk://localhost:2181/fl\tow", "bad cluster URL \"zk://localhost:2181/fl\tow\": the path \"/fl\tow\" has the character '\\t', which ZooKeeper refuses in a path"),
    ];
    for (url, expected) in bad {
        let refused = url.parse::<ClusterUrl>().err().map(|e| e.to_string());
        assert_eq!(refused.as_deref(), Some(expected), "{url}");
    }
}

/// Issue 46 item 3: the first worker records the partition count; a worker of another count is
/// refused naming both, the same count is accepted, and nothing of the refused one joined.
#[tokio::test]
async fn a_worker_with_another_partition_count_is_refused_at_join() -> Result<()> {
    let root = Root::new("partitions")?;
    let first = root.worker("w1").await?;
    first.agree_on_partitions(PIPELINE, 4).await?;
    first.join(PIPELINE).await?;
    let second = root.worker("w2").await?;
    match second.agree_on_partitions(PIPELINE, 2).await {
        Err(ClusterError::PartitionsDiffer {
            recorded,
            partitions,
            ..
        }) => {
            assert_eq!(recorded, "partitions=4");
            assert_eq!(partitions, 2);
        }
        other => bail!("a worker with 2 partitions joined 4: {other:?}"),
    }
    let mut members = first.members(PIPELINE).await?;
    wait_until(&mut members, "the members", |m| *m == set(&["w1"])).await?;
    second.agree_on_partitions(PIPELINE, 4).await?;
    first.close().await;
    second.close().await;
    root.remove().await
}
