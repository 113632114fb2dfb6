//! Key layout of the single sled keyspace.
//!
//! One keyspace with kind-prefixed keys lets every transition be one atomic
//! `apply_batch` (multi-tree transactions are several times slower with fsync).
//! Session ids are validated by the engine to contain no NUL byte, which separates
//! the session id from the big-endian sequence number so per-session ranges sort by
//! `seq`.
//!
//! | prefix | key | value |
//! |---|---|---|
//! | `T` | turn id | `TurnRecord` |
//! | `N` | turn id | the turn's input as JSON text, when at least `INPUT_APART_BYTES` long (written once, at admission) |
//! | `I` | invocation id | `InvocationRecord` (of an unfinished turn, or an earlier attempt not folded) |
//! | `F` | turn id | `FoldedTurn`: a finished turn's record, input inline, with its invocations |
//! | `L` | session, 0, seq | turn id (every turn of the session) |
//! | `A` | session, 0, seq | legacy: turn id of a non-terminal turn (stores written before session metas kept `active_from`; moved at start-up) |
//! | `E` | session, 0, seq | `Event`, or an array of the consecutive events of one transition keyed by the last one's `seq` |
//! | `K` | session, 0, idempotency key | `IdempotencyRecord` |
//! | `M` | session | `SessionMeta` |

use crate::StoreError;

fn simple(prefix: u8, id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + id.len());
    k.push(prefix);
    k.extend_from_slice(id.as_bytes());
    k
}

fn session_seq(prefix: u8, session_id: &str, seq: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + session_id.len() + 8);
    k.push(prefix);
    k.extend_from_slice(session_id.as_bytes());
    k.push(0);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub fn turn(turn_id: &str) -> Vec<u8> {
    simple(b'T', turn_id)
}

/// A turn's input stored apart from its record.
pub fn turn_input(turn_id: &str) -> Vec<u8> {
    simple(b'N', turn_id)
}

/// A finished turn's folded record.
pub fn finished(turn_id: &str) -> Vec<u8> {
    simple(b'F', turn_id)
}

pub fn finished_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'F'], vec![b'F' + 1])
}

/// The turn id of a key of the `F` range.
pub fn finished_turn_id(key: &[u8]) -> Option<&str> {
    std::str::from_utf8(key.strip_prefix(b"F")?).ok()
}

pub fn invocation(invocation_id: &str) -> Vec<u8> {
    simple(b'I', invocation_id)
}

pub fn session_meta(session_id: &str) -> Vec<u8> {
    simple(b'M', session_id)
}

pub fn session_meta_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'M'], vec![b'M' + 1])
}

pub fn session_turn(session_id: &str, seq: u64) -> Vec<u8> {
    session_seq(b'L', session_id, seq)
}

/// Every session's turn list.
pub fn session_turn_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'L'], vec![b'L' + 1])
}

/// The session id of a session-sequenced key (prefix, session, 0, seq).
pub fn session_of(key: &[u8]) -> Option<String> {
    let body = key.get(1..key.len().checked_sub(9)?)?;
    String::from_utf8(body.to_vec()).ok()
}

/// The index of non-terminal turns kept by stores of the earlier format (read only to
/// move such a store to the current one).
pub fn legacy_active(session_id: &str, seq: u64) -> Vec<u8> {
    session_seq(b'A', session_id, seq)
}

pub fn legacy_active_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'A'], vec![b'A' + 1])
}

pub fn turn_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'T'], vec![b'T' + 1])
}

pub fn invocation_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'I'], vec![b'I' + 1])
}

pub fn event(session_id: &str, seq: u64) -> Vec<u8> {
    session_seq(b'E', session_id, seq)
}

/// Exclusive end of a session's event range.
pub fn event_end(session_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + session_id.len());
    k.push(b'E');
    k.extend_from_slice(session_id.as_bytes());
    k.push(1);
    k
}

pub fn idempotency(session_id: &str, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + session_id.len() + key.len());
    k.push(b'K');
    k.extend_from_slice(session_id.as_bytes());
    k.push(0);
    k.extend_from_slice(key.as_bytes());
    k
}

/// The trailing big-endian sequence number of a session-sequenced key.
pub fn seq_suffix(key: &[u8]) -> Result<u64, StoreError> {
    if key.len() < 9 {
        return Err(StoreError::Corrupt(format!("key too short: {key:?}")));
    }
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[key.len() - 8..]);
    Ok(u64::from_be_bytes(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_keys_sort_by_seq_and_stay_in_their_session() {
        assert!(event("s", 2) < event("s", 10));
        assert!(event("s", 255) < event("s", 256));
        assert!(event("s", u64::MAX) < event_end("s"));
        // "s" and "s1" must not interleave.
        assert!(event_end("s") < event("s1", 0));
        assert_eq!(seq_suffix(&session_turn("abc", 77)).expect("seq"), 77);
    }
}
