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
//! | `L` | session, 0, seq, route | turn id (every turn of the session) |
//! | `E` | session, 0, seq, route | `Event`, or an array of the consecutive events of one transition keyed by the last one's `seq` |
//! | `K` | session, 0, idempotency key, 0, route | `IdempotencyRecord` |
//! | `M` | session | `SessionMeta` |
//! | `W` | window start (u64 BE) | the commit dropping that time window (empty; in sled, the lsn that dropped it) |
//!
//! **Routes.** A session's turn list entries, event values and idempotency keys end in
//! a *route*: the [`ROUTE_BYTES`]-byte big-endian UUIDv7 time (Unix ms) of the turn
//! they belong to (for an event value, the newest turn among its events). The store
//! puts each in the time window of that time, with the folded records of the same
//! turns ([`crate::windows`]), so that dropping a window takes them too. The route
//! comes after the `seq` (or the idempotency key), so a session's keys still sort by
//! `seq`, and a range from `(session, seq)` still starts at that `seq`. Keys of turns
//! whose ids are not minted UUIDv7s have none and stay in the main database; both
//! forms read the same.

use crate::error::StoreError;

/// A key and its value.
pub type Entry = (Vec<u8>, Vec<u8>);

/// The first key after a full page of a scan (the last key with a zero byte appended),
/// or None when the page was the last.
pub fn next_page(page: &[Entry], limit: usize) -> Option<Vec<u8>> {
    if page.len() < limit {
        return None;
    }
    page.last().map(|(k, _)| {
        let mut next = k.clone();
        next.push(0);
        next
    })
}

fn simple(prefix: u8, id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + id.len());
    k.push(prefix);
    k.extend_from_slice(id.as_bytes());
    k
}

fn session_seq(prefix: u8, session_id: &str, seq: u64) -> Vec<u8> {
    session_seq_routed(prefix, session_id, seq, None)
}

/// Bytes of a key's route: a UUIDv7 timestamp is 48 bits of Unix ms.
pub const ROUTE_BYTES: usize = 6;

fn push_route(k: &mut Vec<u8>, ms: u64) {
    k.extend_from_slice(&ms.to_be_bytes()[8 - ROUTE_BYTES..]);
}

fn read_route(b: &[u8]) -> Option<u64> {
    let b: [u8; ROUTE_BYTES] = b.try_into().ok()?;
    let mut full = [0u8; 8];
    full[8 - ROUTE_BYTES..].copy_from_slice(&b);
    Some(u64::from_be_bytes(full))
}

fn session_seq_routed(prefix: u8, session_id: &str, seq: u64, route: Option<u64>) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + session_id.len() + 8 + ROUTE_BYTES);
    k.push(prefix);
    k.extend_from_slice(session_id.as_bytes());
    k.push(0);
    k.extend_from_slice(&seq.to_be_bytes());
    if let Some(ms) = route {
        push_route(&mut k, ms);
    }
    k
}

/// A session-sequenced key (prefix, session, 0, seq, and maybe a route) taken apart:
/// the session id, the `seq` and the route. Session ids hold no zero byte, so the
/// first one ends it.
pub fn split_session_seq(key: &[u8]) -> Option<(&str, u64, Option<u64>)> {
    let body = key.get(1..)?;
    let nul = body.iter().position(|b| *b == 0)?;
    let sid = std::str::from_utf8(&body[..nul]).ok()?;
    let rest = &body[nul + 1..];
    let seq = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
    match rest.len() - 8 {
        0 => Some((sid, seq, None)),
        ROUTE_BYTES => Some((sid, seq, Some(read_route(&rest[8..])?))),
        _ => None,
    }
}

/// The route a key of a session's turn list, events or idempotency keys ends in
/// (None: another kind of key, or one written without a route).
pub fn session_route(key: &[u8]) -> Option<u64> {
    match key.first()? {
        b'L' | b'E' => split_session_seq(key)?.2,
        b'K' => {
            // K, session, 0, idempotency key, 0, route: neither id holds a zero byte.
            let body = &key[1..];
            let first = body.iter().position(|b| *b == 0)?;
            let after = &body[first + 1..];
            let second = after.iter().position(|b| *b == 0)?;
            read_route(&after[second + 1..])
        }
        _ => None,
    }
}

/// Whether `[start, end)` meets the keys that can carry a route (`E`, `K`, `L`).
pub fn meets_routed(start: &[u8], end: &[u8]) -> bool {
    [b'E', b'K', b'L']
        .iter()
        .any(|p| start < &[p + 1][..] && &[*p][..] < end)
}

/// The route of a turn's keys: its id's UUIDv7 time (None: not a minted id).
pub fn route_of(turn_id: &str) -> Option<u64> {
    turn_ms(turn_id)
}

/// The UUIDv7 timestamp of a turn id minted by the daemon (`t_` and 32 hex digits).
pub fn turn_ms(turn_id: &str) -> Option<u64> {
    let hex = turn_id.strip_prefix("t_")?;
    if hex.len() != 32 {
        return None;
    }
    u64::from_str_radix(hex.get(..12)?, 16).ok()
}

/// The time a key is routed by: for a folded record the timestamp of the turn its key
/// names, for a session's turn list entry, event value or idempotency key its route
/// ([`session_route`]). None: a key of the main database (any other kind, one
/// without a route, or one of a turn id that is not minted).
pub fn routed_ms(key: &[u8]) -> Option<u64> {
    match key.first()? {
        b'F' => turn_ms(finished_turn_id(key)?),
        _ => session_route(key),
    }
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

/// Where a session's turn list is at `seq` without a route: the key of an entry of a
/// turn id that is not minted, and the bound of a range from `seq`.
pub fn session_turn(session_id: &str, seq: u64) -> Vec<u8> {
    session_seq(b'L', session_id, seq)
}

/// The turn list entry of `turn_id` at `seq`, routed by the turn.
pub fn session_turn_of(session_id: &str, seq: u64, turn_id: &str) -> Vec<u8> {
    session_seq_routed(b'L', session_id, seq, route_of(turn_id))
}

/// Every session's turn list.
pub fn session_turn_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'L'], vec![b'L' + 1])
}

/// The session id of a session-sequenced key (prefix, session, 0, seq, route).
pub fn session_of(key: &[u8]) -> Option<String> {
    split_session_seq(key).map(|(s, _, _)| s.to_string())
}

pub fn turn_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'T'], vec![b'T' + 1])
}

pub fn invocation_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'I'], vec![b'I' + 1])
}

/// A session's events at `seq` without a route: the key of a value holding an event
/// of a turn id that is not minted, and the bound of a range from `seq`.
pub fn event(session_id: &str, seq: u64) -> Vec<u8> {
    session_seq(b'E', session_id, seq)
}

/// An event value's key: its last event's `seq`, and its route (the newest turn
/// among its events), when it has one.
pub fn event_routed(session_id: &str, seq: u64, route: Option<u64>) -> Vec<u8> {
    session_seq_routed(b'E', session_id, seq, route)
}

/// Exclusive end of a session's event range.
pub fn event_end(session_id: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(2 + session_id.len());
    k.push(b'E');
    k.extend_from_slice(session_id.as_bytes());
    k.push(1);
    k
}

/// An idempotency key without a route (naming a turn id that is not minted).
pub fn idempotency(session_id: &str, key: &str) -> Vec<u8> {
    let mut k = Vec::with_capacity(3 + session_id.len() + key.len() + ROUTE_BYTES);
    k.push(b'K');
    k.extend_from_slice(session_id.as_bytes());
    k.push(0);
    k.extend_from_slice(key.as_bytes());
    k
}

/// An idempotency key naming `turn_id`, routed by it.
pub fn idempotency_of(session_id: &str, key: &str, turn_id: &str) -> Vec<u8> {
    let mut k = idempotency(session_id, key);
    if let Some(ms) = route_of(turn_id) {
        k.push(0);
        push_route(&mut k, ms);
    }
    k
}

/// The range holding an idempotency key in either form (with or without a route):
/// an idempotency key holds no zero byte, so nothing else falls in it.
pub fn idempotency_range(session_id: &str, key: &str) -> (Vec<u8>, Vec<u8>) {
    let start = idempotency(session_id, key);
    let mut end = start.clone();
    end.push(1);
    (start, end)
}

/// The key whose commit drops the time window starting at `start_ms`.
pub fn dropped_key(start_ms: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(9);
    k.push(b'W');
    k.extend_from_slice(&start_ms.to_be_bytes());
    k
}

/// The window start a key of [`dropped_key`] names.
pub fn dropped_start(key: &[u8]) -> Option<u64> {
    let b: [u8; 8] = key.strip_prefix(b"W")?.try_into().ok()?;
    Some(u64::from_be_bytes(b))
}

pub fn dropped_range() -> (Vec<u8>, Vec<u8>) {
    (vec![b'W'], vec![b'W' + 1])
}

/// The sequence number of a session-sequenced key.
pub fn seq_suffix(key: &[u8]) -> Result<u64, StoreError> {
    split_session_seq(key)
        .map(|(_, seq, _)| seq)
        .ok_or_else(|| StoreError::Corrupt(format!("not a session-sequenced key: {key:?}")))
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

    const TURN: &str = "t_0192d3f2a1b27000800000000000000a";

    /// A route follows the `seq`: routed keys sort by `seq` among unrouted ones, stay
    /// in the range from their `seq`, and come apart into what built them.
    #[test]
    fn routed_keys_sort_by_seq_and_come_apart() {
        let ms = 0x0192d3f2a1b2;
        let routed = session_turn_of("s", 7, TURN);
        assert_eq!(split_session_seq(&routed), Some(("s", 7, Some(ms))));
        assert_eq!(
            split_session_seq(&session_turn("s", 7)),
            Some(("s", 7, None))
        );
        assert_eq!(session_route(&routed), Some(ms));
        assert_eq!(session_route(&session_turn("s", 7)), None);
        assert_eq!(seq_suffix(&routed).expect("seq"), 7);
        assert_eq!(session_of(&routed).as_deref(), Some("s"));
        assert!(session_turn("s", 7) <= routed && routed < session_turn("s", 8));
        assert!(session_turn_of("s", 6, TURN) < session_turn("s", 7));
        // A route of all ones still sorts before the next seq.
        let top = event_routed("s", 7, Some((1 << 48) - 1));
        assert!(top < event("s", 8) && top < event_end("s"));
        // A turn id that is not minted gives no route.
        assert_eq!(session_turn_of("s", 7, "t1"), session_turn("s", 7));

        let k = idempotency_of("s", "key", TURN);
        assert_eq!(session_route(&k), Some(ms));
        assert_eq!(session_route(&idempotency("s", "key")), None);
        let (a, b) = idempotency_range("s", "key");
        assert!(a <= k && k < b);
        assert!(idempotency("s", "key") >= a && idempotency("s", "key") < b);
        // Another key of the same session is outside it.
        assert!(idempotency_of("s", "key2", TURN) >= b);
        assert!(idempotency_of("s", "ke", TURN) < a);

        assert!(meets_routed(&event("s", 0), &event_end("s")));
        assert!(!meets_routed(b"F", b"G"));
        assert!(!meets_routed(b"M", b"N"));
        assert!(meets_routed(b"A", b"Z"));
    }
}
