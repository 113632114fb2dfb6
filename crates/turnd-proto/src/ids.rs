//! Identifiers minted by the daemon.
//!
//! Ids are UUIDv7 (time ordered) with a short kind prefix, so they sort by creation
//! in the store and a human can tell a turn id from an invocation id at a glance.

fn mint(prefix: &str) -> String {
    format!("{prefix}{}", uuid::Uuid::now_v7().simple())
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
        Some(hex) => format!("inv_{}_{hex}", uuid::Uuid::now_v7().simple()),
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
}
