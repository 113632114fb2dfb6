//! Partitions: which of a cluster's partitions a session, a turn and an invocation
//! belong to, computed from the id alone, so that every request can be routed to the
//! node that leads its partition without a lookup.
//!
//! A session's partition is the xxHash3 (64-bit) of its id modulo the cluster's fixed
//! number of partitions; every turn of the session is minted in that partition, its
//! id carrying the partition in its last 12 bits ([`new_turn_id_in`]), and every
//! invocation id carries its turn's 32 hex digits ([`crate::ids::new_invocation_id_of`]).
//! xxHash3 is stable across versions and platforms, so every node and every client
//! agrees. One daemon without a cluster mints ids with random last bits and never asks.

use xxhash_rust::xxh3::xxh3_64;

use crate::ids::{invocation_turn_id, turn_id_bits};

/// The most partitions a cluster may have: the partition of a turn is kept in 12 bits
/// of its id.
pub const MAX_PARTITIONS: u32 = 1 << PARTITION_BITS;

const PARTITION_BITS: u32 = 12;
const PARTITION_MASK: u128 = (1 << PARTITION_BITS) - 1;

/// The partition of `session_id` among `partitions` (at least 1).
pub fn session_partition(session_id: &str, partitions: u32) -> u32 {
    let n = u64::from(partitions.max(1));
    // The remainder is below `partitions`, a u32.
    (xxh3_64(session_id.as_bytes()) % n) as u32
}

/// A new turn id, `t_…`, minted in `partition` (below [`MAX_PARTITIONS`]): a UUIDv7
/// whose last 12 bits (random in a UUIDv7, after its time and counter) are the
/// partition, so ids still sort by creation.
pub fn new_turn_id_in(partition: u32) -> String {
    let bits = uuid::Uuid::now_v7().as_u128();
    let bits = (bits & !PARTITION_MASK) | (u128::from(partition) & PARTITION_MASK);
    format!("t_{}", uuid::Uuid::from_u128(bits).simple())
}

/// The partition a turn id minted by [`new_turn_id_in`] names; `None` for a string
/// that is not a turn id of this daemon. Meaningful only in a cluster, where every
/// turn id is minted that way.
pub fn turn_partition(turn_id: &str) -> Option<u32> {
    turn_id_bits(turn_id).map(|b| (b & PARTITION_MASK) as u32)
}

/// The partition of an invocation id (that of its turn); `None` for an id that does
/// not name its turn.
pub fn invocation_partition(invocation_id: &str) -> Option<u32> {
    turn_partition(&invocation_turn_id(invocation_id)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::new_invocation_id_of;

    #[test]
    fn ids_carry_their_partition_and_still_sort_by_creation() {
        for p in [0, 1, 7, 63, MAX_PARTITIONS - 1] {
            let a = new_turn_id_in(p);
            let b = new_turn_id_in(p);
            assert!(a.starts_with("t_") && a.len() == 34, "{a}");
            assert!(a < b, "ids of one partition sort by creation: {a} {b}");
            assert_eq!(turn_partition(&a), Some(p));
            assert_eq!(invocation_partition(&new_invocation_id_of(&a)), Some(p));
            // Still a UUIDv7 (version and variant bits untouched).
            let hex = a.trim_start_matches("t_");
            let u = uuid::Uuid::parse_str(hex).expect("a uuid");
            assert_eq!(u.get_version_num(), 7);
            assert_eq!(u.get_variant(), uuid::Variant::RFC4122);
        }
        assert_eq!(turn_partition("t-other"), None);
        assert_eq!(invocation_partition("inv_x"), None);
    }

    #[test]
    fn sessions_spread_over_the_partitions_the_same_way_everywhere() {
        // Fixed values, the same as any XXH3-64 implementation gives (Python's
        // `xxhash.xxh3_64_intdigest`, say): every node and client must agree, whatever
        // the platform.
        let fixed: Vec<(u64, u32)> = ["s-1", "s-2", "chat-42", ""]
            .iter()
            .map(|s| (xxh3_64(s.as_bytes()), session_partition(s, 64)))
            .collect();
        assert_eq!(
            fixed,
            [
                (0x6c0a_94fc_1286_f81b, 27),
                (0xe6f8_7634_6f7a_89ec, 44),
                (0xf8e9_428b_ba55_5b48, 8),
                (0x2d06_8005_38d3_94c2, 2)
            ]
        );
        let mut counts = [0u32; 8];
        for i in 0..8000 {
            counts[session_partition(&format!("session-{i}"), 8) as usize] += 1;
        }
        assert!(counts.iter().all(|c| (800..1200).contains(c)), "{counts:?}");
    }
}
