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
