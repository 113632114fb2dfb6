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

/// A new invocation id, `inv_…`.
pub fn new_invocation_id() -> String {
    mint("inv_")
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
    }
}
