//! Compare-and-set writes against a real nats-server (`Bus::put_expecting`, which the
//! allocator uses for every plan and job status): a replaced leader's late write, based on
//! the revision it read before the new leader wrote, is refused and leaves the new leader's
//! value in place.

use converge_bus::BusError;
use converge_common::{HostId, HostPlan, PROTOCOL_VERSION};
use converge_tests::*;

fn plan() -> HostPlan {
    HostPlan {
        protocol: PROTOCOL_VERSION,
        host: HostId::new("n1").unwrap(),
        workers: Vec::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replaced_leaders_late_write_does_not_stick() {
    init_tracing();
    let nats = NatsServer::start();
    let old_leader = nats.bus().await;
    let new_leader = nats.bus().await;

    // Both read the key absent; the old leader creates it.
    let first = old_leader
        .put_expecting(&old_leader.plans, "n1", &plan(), None)
        .await
        .expect("created");
    // A second create on an existing key conflicts.
    let again = new_leader
        .put_expecting(&new_leader.plans, "n1", &plan(), None)
        .await;
    assert!(
        matches!(again, Err(BusError::Conflict { expected: None, .. })),
        "{again:?}"
    );

    // Both have read revision `first`. The new leader writes on it...
    let second = new_leader
        .put_expecting(&new_leader.plans, "n1", &plan(), Some(first))
        .await
        .expect("the new leader's write");
    assert!(second > first);
    // ... and the old leader's late write on the same revision is refused.
    let late = old_leader
        .put_expecting(&old_leader.plans, "n1", &plan(), Some(first))
        .await;
    match late {
        Err(e @ BusError::Conflict { .. }) => {
            assert!(
                e.to_string().contains("changed since revision Some("),
                "{e}"
            );
        }
        other => panic!("the late write went through: {other:?}"),
    }
    let (_, revision) = new_leader
        .get::<HostPlan>(&new_leader.plans, "n1")
        .await
        .unwrap()
        .expect("stored");
    assert_eq!(revision, second, "the new leader's write stays");
    // Writing on the revision it now reads works again.
    old_leader
        .put_expecting(&old_leader.plans, "n1", &plan(), Some(second))
        .await
        .expect("a write on the current revision");
}
