//! Where each partition would rather be: the node that should lead it and the nodes
//! that keep a warm standby of it, among the nodes alive now.
//!
//! Rendezvous (highest random weight) hashing: each node scores each partition by the
//! xxHash3 of the pair, and the partition's nodes are the live ones in descending
//! score. Every node computes the same answer from the same list of live nodes, with
//! no coordination; when a node joins or leaves, only the partitions it ranks first
//! (or among the standbys) move, about `1 / nodes` of them. The placement is what
//! nodes aim for, never what is safe: leadership is taken by the lease and made
//! harmless by the stream's validity rule.

use turnd_cluster::lease::Lease;
use xxhash_rust::xxh3::xxh3_64;

/// A partition's nodes in order of preference: the first should lead, the next
/// `standbys` keep a warm standby.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub leader: String,
    pub standbys: Vec<String>,
}

impl Placement {
    /// Whether `node` is this partition's preferred leader or one of its standbys.
    pub fn holds(&self, node: &str) -> bool {
        self.leader == node || self.standbys.iter().any(|s| s == node)
    }
}

/// What a node knows of a partition's lease as it decides whether to take it.
pub(crate) struct LeaseView<'a> {
    pub me: &'a str,
    pub now: u64,
    pub lease_ms: u64,
    /// The lease as read now (None: absent, released by a hand-over or never taken).
    pub held: Option<&'a Lease>,
    /// How long this node has read the lease absent (ms).
    pub absent_for: u64,
    /// Whether the holder's heartbeat was heard within a lease.
    pub holder_heard: bool,
    /// Whether the owners bucket failed to answer this node within two leases.
    pub owners_silent: bool,
}

/// Whether a node should take the lease of a partition placed as `pl`:
///
/// - its own lease from before it restarted, at once;
/// - an absent lease, at once when it is the preferred leader (a hand-over releases
///   the lease for it), after a lease of absence when it keeps a standby (a standby
///   that took it first would hand it over again, back and forth);
/// - a lease that ran out, half a lease past its end when it is the preferred
///   leader (the holder, whose renewal was late, stops serving at its next round
///   instead of having its log fenced under the writes in flight), a whole lease
///   past it when it keeps a standby; but never while the holder's heartbeat is
///   heard and the owners bucket failed to answer within two leases: the holder
///   may have led on meanwhile, its partition's stream saying nobody fenced it,
///   and renews the lease within a round of the bucket's answers;
/// - a running lease of another node, never.
pub(crate) fn should_take(pl: &Placement, v: &LeaseView) -> bool {
    let preferred = pl.leader == v.me;
    let free_for = match v.held {
        None if preferred => u64::MAX,
        None => v.absent_for,
        Some(l) if l.owner.node == v.me => u64::MAX,
        Some(l) if l.runs_at(v.now) => return false,
        Some(_) if v.holder_heard && v.owners_silent => return false,
        // A lease without an end is never free by time.
        Some(l) => match l.owner.until_ms {
            Some(u) => v.now.saturating_sub(u),
            None => return false,
        },
    };
    (preferred && free_for >= v.lease_ms / 2) || (pl.holds(v.me) && free_for >= v.lease_ms)
}

fn score(partition: u32, node: &str) -> u64 {
    let mut key = Vec::with_capacity(4 + node.len());
    key.extend_from_slice(&partition.to_be_bytes());
    key.extend_from_slice(node.as_bytes());
    xxh3_64(&key)
}

/// The placement of `partition` among `nodes` (live node ids, in any order, without
/// repeats), with up to `standbys` standbys; `None` when no node is alive.
pub fn place(partition: u32, nodes: &[String], standbys: usize) -> Option<Placement> {
    let mut ranked: Vec<(u64, &String)> = nodes.iter().map(|n| (score(partition, n), n)).collect();
    // Ties (never seen in practice) are broken by the id, so every node agrees.
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    let mut it = ranked.into_iter().map(|(_, n)| n.clone());
    let leader = it.next()?;
    Some(Placement {
        leader,
        standbys: it.take(standbys).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use turnd_cluster::lease::Owner;

    /// Partition 0 placed on n1 (leading) and n2 (standby); n3 holds nothing.
    fn placed() -> Placement {
        Placement {
            leader: "n1".into(),
            standbys: vec!["n2".into()],
        }
    }

    fn lease(node: &str, until_ms: u64) -> Lease {
        Lease {
            partition: 0,
            owner: Owner {
                node: node.into(),
                epoch: 1,
                until_ms: Some(until_ms),
            },
            revision: 7,
        }
    }

    /// Whether `me` takes `held` at `now` (a lease of 900 ms), with the rest of
    /// what it knows.
    fn takes(
        me: &str,
        held: Option<&Lease>,
        now: u64,
        absent_for: u64,
        holder_heard: bool,
        owners_silent: bool,
    ) -> bool {
        should_take(
            &placed(),
            &LeaseView {
                me,
                now,
                lease_ms: 900,
                held,
                absent_for,
                holder_heard,
                owners_silent,
            },
        )
    }

    #[test]
    fn an_absent_lease_goes_to_the_preferred_leader_and_to_a_standby_only_a_lease_later() {
        assert!(takes("n1", None, 10_000, 0, false, false));
        assert!(!takes("n2", None, 10_000, 0, false, false));
        assert!(!takes("n2", None, 10_000, 899, false, false));
        assert!(takes("n2", None, 10_000, 900, false, false));
        assert!(
            !takes("n3", None, 10_000, 10_000, false, false),
            "not placed"
        );
    }

    #[test]
    fn a_lease_that_ran_out_goes_half_a_lease_later_to_the_preferred_leader_a_lease_to_a_standby() {
        let l = lease("n3", 10_000);
        assert!(!takes("n1", Some(&l), 9_999, 0, false, false), "it runs");
        assert!(!takes("n1", Some(&l), 10_449, 0, false, false));
        assert!(takes("n1", Some(&l), 10_450, 0, false, false));
        assert!(!takes("n2", Some(&l), 10_899, 0, false, false));
        assert!(takes("n2", Some(&l), 10_900, 0, false, false));
        // Its own lease from before a restart, at once.
        assert!(takes(
            "n2",
            Some(&lease("n2", 20_000)),
            10_000,
            0,
            false,
            false
        ));
    }

    #[test]
    fn a_heard_holder_keeps_its_run_out_lease_while_the_owners_bucket_was_silent() {
        let l = lease("n3", 10_000);
        // Long past its end: heard, with the bucket silent lately, it is not taken.
        assert!(!takes("n1", Some(&l), 30_000, 0, true, true));
        assert!(!takes("n2", Some(&l), 30_000, 0, true, true));
        // A holder not heard (it died) or a bucket that answered: taken.
        assert!(takes("n1", Some(&l), 30_000, 0, false, true));
        assert!(takes("n1", Some(&l), 30_000, 0, true, false));
    }

    fn nodes(ids: &[&str]) -> Vec<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn every_node_agrees_and_a_partition_moves_only_when_its_nodes_change() {
        let three = nodes(&["n1", "n2", "n3"]);
        let mut reversed = three.clone();
        reversed.reverse();
        for p in 0..64 {
            assert_eq!(place(p, &three, 1), place(p, &reversed, 1));
            let pl = place(p, &three, 1).expect("a placement");
            assert_ne!(pl.leader, pl.standbys[0]);
            assert!(pl.holds(&pl.leader) && pl.holds(&pl.standbys[0]));
        }
        // Each of three nodes leads about a third of 300 partitions.
        let mut led = [0; 3];
        for p in 0..300 {
            let l = place(p, &three, 1).expect("a placement").leader;
            led[three.iter().position(|n| *n == l).expect("one of them")] += 1;
        }
        assert!(led.iter().all(|c| (70..130).contains(c)), "{led:?}");
        // A fourth node takes only partitions it now ranks first; the others keep
        // their leader.
        let four = nodes(&["n1", "n2", "n3", "n4"]);
        let mut moved = 0;
        for p in 0..300 {
            let before = place(p, &three, 1).expect("a placement").leader;
            let after = place(p, &four, 1).expect("a placement").leader;
            if before != after {
                assert_eq!(after, "n4", "partition {p} moved between old nodes");
                moved += 1;
            }
        }
        assert!(
            (45..105).contains(&moved),
            "{moved} of 300 moved to the new node"
        );
        // Standbys are bounded, and a lone node has none.
        assert_eq!(place(0, &four, 2).expect("a placement").standbys.len(), 2);
        assert!(place(0, &nodes(&["n1"]), 1)
            .expect("a placement")
            .standbys
            .is_empty());
        assert_eq!(place(0, &[], 1), None);
    }
}
