//! Identifiers minted by the daemon.
//!
//! Ids are UUIDv7 (time ordered) with a short kind prefix, so they sort by creation
//! in the store and a human can tell a turn id from an invocation id at a glance.
//!
//! A thread may mint from a source of its own instead of the clock and the random
//! generator ([`mint_from`]): the simulator (`crates/turnd-sim`) runs a whole daemon
//! on one thread and needs every id to follow from its seed.

use std::cell::RefCell;

/// Where a thread's ids come from when not from the clock and the random generator:
/// the 128 bits of the next id.
pub type IdSource = Box<dyn FnMut() -> u128>;

thread_local! {
    static SOURCE: RefCell<Option<IdSource>> = const { RefCell::new(None) };
}

/// Mint the ids of this thread from `source` until the returned guard is dropped (a
/// source set before is put back then). The bits should be a UUIDv7's (time first)
/// so that ids still sort by creation.
pub fn mint_from(source: IdSource) -> MintGuard {
    MintGuard(SOURCE.with(|s| s.borrow_mut().replace(source)))
}

/// Ends a [`mint_from`] when dropped.
pub struct MintGuard(Option<IdSource>);

impl Drop for MintGuard {
    fn drop(&mut self) {
        let before = self.0.take();
        SOURCE.with(|s| *s.borrow_mut() = before);
    }
}

/// The 32 hex digits of a new id: from the thread's source, or a UUIDv7.
fn fresh_hex() -> String {
    let own = SOURCE.with(|s| s.borrow_mut().as_mut().map(|next| next()));
    match own {
        Some(bits) => format!("{bits:032x}"),
        None => uuid::Uuid::now_v7().simple().to_string(),
    }
}

fn mint(prefix: &str) -> String {
    format!("{prefix}{}", fresh_hex())
}

/// A new turn id, `t_…`.
pub fn new_turn_id() -> String {
    mint("t_")
}

/// The 128 bits of a turn id this daemon minted (`t_` and 32 hex digits), for
/// compact in-memory indexes; `None` for any other string.
pub fn turn_id_bits(turn_id: &str) -> Option<u128> {
    let hex = turn_id.strip_prefix("t_")?;
    if hex.len() != 32 {
        return None;
    }
    u128::from_str_radix(hex, 16).ok()
}

/// A new invocation id, `inv_…`.
pub fn new_invocation_id() -> String {
    mint("inv_")
}

/// A new invocation id for a step of `turn_id`, `inv_…_…`: its own UUIDv7 and the
/// turn's 32 hex digits, so that the record of an invocation folded into its finished
/// turn is found from the invocation id alone ([`invocation_turn_id`]).
pub fn new_invocation_id_of(turn_id: &str) -> String {
    match turn_id
        .strip_prefix("t_")
        .filter(|h| turn_id_bits(turn_id).is_some() && h.len() == 32)
    {
        Some(hex) => format!("inv_{}_{hex}", fresh_hex()),
        None => new_invocation_id(),
    }
}

/// The turn id an invocation id made by [`new_invocation_id_of`] names (None for any
/// other string).
pub fn invocation_turn_id(invocation_id: &str) -> Option<String> {
    let rest = invocation_id.strip_prefix("inv_")?;
    let (own, hex) = rest.split_once('_')?;
    if own.len() != 32 || hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(format!("t_{hex}"))
}

/// A new watch id, `w_…`.
pub fn new_watch_id() -> String {
    mint("w_")
}

/// A new connection id, `c_…`.
pub fn new_connection_id() -> String {
    mint("c_")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_prefixed_and_unique() {
        let a = new_turn_id();
        let b = new_turn_id();
        assert!(a.starts_with("t_"));
        assert!(new_invocation_id().starts_with("inv_"));
        assert_ne!(a, b);
        assert!(a < b, "v7 ids sort by creation: {a} {b}");
        assert!(turn_id_bits(&a).is_some() && turn_id_bits(&a) != turn_id_bits(&b));
        assert_eq!(turn_id_bits(&new_invocation_id()), None);
        let inv = new_invocation_id_of(&a);
        assert!(
            inv.starts_with("inv_") && inv.len() == 4 + 32 + 1 + 32,
            "{inv}"
        );
        assert_eq!(invocation_turn_id(&inv).as_deref(), Some(a.as_str()));
        assert!(new_invocation_id_of(&a) != inv);
        assert_eq!(invocation_turn_id(&new_invocation_id()), None);
        assert_eq!(invocation_turn_id("inv_x"), None);
        assert!(new_invocation_id_of("t-other").starts_with("inv_"));
        assert_eq!(invocation_turn_id(&new_invocation_id_of("t-other")), None);
    }

    #[test]
    fn a_thread_mints_from_its_own_source_while_the_guard_lives() {
        let mut n = 0u128;
        let guard = mint_from(Box::new(move || {
            n += 1;
            n
        }));
        assert_eq!(new_turn_id(), format!("t_{:032x}", 1));
        let turn = new_turn_id();
        assert_eq!(
            new_invocation_id_of(&turn),
            format!("inv_{:032x}_{:032x}", 3, 2)
        );
        // Another thread is not affected.
        let other = std::thread::spawn(new_turn_id).join().expect("thread");
        assert_ne!(other, format!("t_{:032x}", 4));
        drop(guard);
        assert_ne!(new_turn_id(), format!("t_{:032x}", 4));
    }
}
