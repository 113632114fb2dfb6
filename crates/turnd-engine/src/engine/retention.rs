//! Retention: terminal turns older than `retention_terminal_ms` are deleted.
//!
//! A sweep runs every `retention_sweep_interval_ms`. It reads the turn records in key
//! order (turn ids are UUIDv7, so oldest first) and stops at the first turn created
//! after the cutoff (`now - retention_terminal_ms`): a turn cannot have finished
//! before it was created. It gathers the terminal turns among them whose
//! `finished_at_ms` is at or before the cutoff (up to [`SWEEP_BATCH`] at a time),
//! groups them by session and deletes each session's in one durable batch (up to
//! [`SESSIONS_AT_ONCE`] sessions at the same time, whose batches share group
//! commits), with everything that belongs to them alone:
//!
//! - its folded record (or, for a turn of the earlier layout, its record and its
//!   input stored apart);
//! - its idempotency key (when it still names this turn), so the key can be used
//!   again;
//! - its invocations (the last one from the record, the others under their own keys,
//!   found by the dispatch time their ids begin with: [`early_invocations`]);
//! - its place in the session's turn list and its events, unless they are left to
//!   the drop of its time window ([`left_to_window`]: its keys are in an open window
//!   and it comes before the session's first unfinished turn). Reads pass over the
//!   entries and events of turns that are no longer stored (`turn.list`,
//!   `Store::events`), and a window's drop deletes its directory whole, so deleting
//!   them key by key would only load the applier (it about doubled its sled writes
//!   under retention at full load). Otherwise, the session's stored event values are
//!   read from the first up to the first value written after the cutoff; a value
//!   whose events all belong to turns that are gone is deleted, one that mixes them
//!   with events of turns that remain is written again with the remaining events
//!   only.
//!
//! The session meta's counts drop by the deleted turns. A session left with no turn at
//! all, no unfinished work, no watcher and no timer is forgotten: its meta, every
//! entry of its turn list and every remaining event value are deleted and its cell
//! leaves memory, so `session.inspect` answers `not_found`, and a later submit starts
//! it again from `seq` 1 with nothing of the old session left to read. Unfinished
//! turns are never deleted, however old.
//!
//! **Windows.** After the deletions, a window that holds no stored turn any more
//! ([`empty_windows`]) is dropped, with, in the same batch, its event values that
//! also hold events of an older turn still stored written again without the others
//! ([`rescue`]).
//!
//! **No stalls.** Everything a sweep reads (turn records, idempotency keys, event
//! values) is read *without* the session's lock, on a blocking thread: a read that
//! waits for sled (an apply round or a checkpoint holding it) delays the sweep, never
//! the session. The lock is taken only to check that nothing changed what was read
//! and to commit. A terminal turn changes only with a transition of its session, and
//! every transition appends an event, so the check is the session's last event
//! `seq`: when it moved since the reads, the events written since are read (again
//! without the lock) and the sweep leaves the session for the next sweep if any of
//! them is about a turn it meant to delete (a late result amending it); otherwise it
//! checks again. After a few rounds of a very busy session, that last read is done
//! under the lock.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::runtime::RuntimeFlavor;
use turnd_proto::{Event, EventKind, TurnCounts, TurnStatus};
use turnd_store::{keys, windows, Batch, SessionKeys, SessionMeta, Store, StoreError, WindowInfo};

use super::{Engine, SessionCell};

/// Turn records read per page of a sweep.
const TURN_PAGE: usize = 512;
/// Most turns a sweep gathers before it deletes them (and reads on). Each batch reads
/// every session it touches from the session's first stored event value, so a
/// smaller batch reads the same values again: with 4096, a sweep at 10,000 turns/s
/// (100 sessions) deleted about half as many turns per second as this one and fell
/// behind (`docs/benchmarks.md`). A batch holds about 200 bytes per turn while it is
/// deleted.
const SWEEP_BATCH: usize = 16384;
/// Sessions whose expired turns a sweep deletes at the same time.
const SESSIONS_AT_ONCE: usize = 64;
/// Event values read per page of a session's event scan.
const EVENT_PAGE: usize = 64;
/// Times the lock-free check of a session's new events is repeated before it is done
/// under the lock.
const RECHECKS: usize = 4;
/// Longest a sweep holds back one session's deletes while the store is behind
/// ([`turnd_store::Kv::busy`]), so that under a load that keeps it behind the sweep
/// still moves on.
const HOLD_BACK_MAX: Duration = Duration::from_millis(20);

/// A terminal turn to delete, as the sweep read it.
struct Expired {
    turn_id: String,
    seq: u64,
    status: TurnStatus,
    idempotency_key: Option<String>,
    invocation_id: Option<String>,
    /// Read from its folded record: the invocations folded into it. Folding deleted
    /// the turn's own record, its input stored apart and these invocations' keys in
    /// the same batch, so none of them is deleted again (a delete of a key that is not
    /// there still takes a place in the commit log, the overlay and the applier's
    /// sled work). None: a record under its own key (the earlier layout).
    folded: Option<Vec<String>>,
}

/// What deleting one session's expired turns writes, read without its lock.
struct Plan {
    batch: Batch,
    gone: HashSet<String>,
    statuses: Vec<TurnStatus>,
    pruned: bool,
    /// Keys of every event value of the session (read only when the session was
    /// expected to be left with no turn, to forget it).
    all_values: Option<Vec<Vec<u8>>>,
    /// Keys of every entry of its turn list (read with `all_values`).
    all_entries: Option<Vec<Vec<u8>>>,
}

/// What a sweep read of a session under its lock before planning its deletes.
struct Planned {
    counts: TurnCounts,
    active_from: Option<u64>,
    open: Arc<Open>,
    early: Arc<Early>,
}

/// Keys of invocation records under their own keys dispatched at or before a sweep's
/// cutoff, by turn ([`early_invocations`]).
type Early = HashMap<String, Vec<Vec<u8>>>;

/// Invocation records read per page of [`early_invocations`].
const INVOCATION_PAGE: usize = 1024;

/// The invocation records under their own keys (in the main database) whose ids were
/// minted at or before `cutoff` (wall clock), by turn. A finished turn's last invocation is folded into its
/// record; those of its earlier steps and attempts stay under their own keys until
/// retention deletes them with the turn. A turn's events name them, but a turn left
/// to its window has none read ([`left_to_window`]), so they are found here: an
/// invocation id begins with its own UUIDv7 (`inv_` and 32 hex digits), so the keys
/// are in dispatch order and the read stops at the cutoff. What it reads is what was
/// dispatched since the last sweep's cutoff, and the invocations of turns that have
/// run longer than `retention_terminal_ms`. One whose turn is gone by the time it is
/// read (minted with a wall clock ahead of the engine's) is deleted then.
fn early_invocations(store: &Store, cutoff: u64) -> Result<Early, StoreError> {
    let mut from = keys::invocation("inv_");
    let end = keys::invocation(&format!("inv_{:012x}", cutoff.saturating_add(1)));
    let mut out: Early = HashMap::new();
    loop {
        let page = store.kv().scan(&from, &end, false, INVOCATION_PAGE)?;
        for (k, v) in &page {
            let inv: turnd_store::InvocationRecord = serde_json::from_slice(v)
                .map_err(|e| StoreError::Corrupt(format!("invocation: {e}")))?;
            out.entry(inv.turn_id).or_default().push(k.clone());
        }
        match page.last() {
            Some((k, _)) if page.len() == INVOCATION_PAGE => {
                from = k.clone();
                from.push(0);
            }
            _ => return Ok(out),
        }
    }
}

/// Run a function that reads the store: on the blocking pool of a multi-threaded
/// runtime (a sled read may wait for an apply round or a checkpoint), inline
/// elsewhere (tests on a current-thread runtime).
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    let multi = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == RuntimeFlavor::MultiThread);
    if !multi {
        return f();
    }
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Read(format!("retention read task: {e}")))?
}

/// From `from` on, the expired turns of up to [`SWEEP_BATCH`] (a page more at most),
/// by session, and where the next gathering starts (None: past the cutoff or at the
/// end). Finished turns' folded records (`F` keys) are read first, then the records
/// under their own keys (`T`: unfinished turns, and finished ones of the earlier
/// layout); `from` is a key of either range.
#[allow(clippy::type_complexity)]
fn gather(
    store: &Store,
    mut from: Vec<u8>,
    cutoff: u64,
) -> Result<(BTreeMap<String, Vec<Expired>>, Option<Vec<u8>>), StoreError> {
    let mut by_session: BTreeMap<String, Vec<Expired>> = BTreeMap::new();
    let mut n = 0;
    let (turn_start, _) = keys::turn_range();
    loop {
        let folded_phase = from.is_empty() || from.first() == Some(&b'F');
        let (page, next) = if folded_phase {
            let (page, next) = store.finished_page(&from, TURN_PAGE)?;
            let page: Vec<_> = page
                .into_iter()
                .map(|f| {
                    let folded = f.invocations.into_iter().map(|i| i.invocation_id);
                    (f.turn, Some(folded.collect()))
                })
                .collect();
            (page, next)
        } else {
            let (page, next) = store.turns_page(&from, TURN_PAGE)?;
            (page.into_iter().map(|t| (t, None)).collect(), next)
        };
        let mut past_cutoff = false;
        for (t, folded) in page {
            if t.created_at_ms > cutoff {
                past_cutoff = true;
                break;
            }
            if t.status.is_terminal() && t.finished_at_ms.is_some_and(|f| f <= cutoff) {
                n += 1;
                by_session.entry(t.session_id).or_default().push(Expired {
                    turn_id: t.turn_id,
                    seq: t.seq,
                    status: t.status,
                    idempotency_key: t.idempotency_key,
                    invocation_id: t.invocation_id,
                    folded,
                });
            }
        }
        let next = match (past_cutoff, next) {
            (false, Some(next)) => Some(next),
            // The end of the folded records (or of what can have expired there):
            // on to the records under their own keys.
            _ if folded_phase => Some(turn_start.clone()),
            _ => None,
        };
        match next {
            Some(next) if n < SWEEP_BATCH => from = next,
            next => return Ok((by_session, next)),
        }
    }
}

/// How long after a window's end turn ids may still be minted in it and not yet be
/// stored (an admission in progress); such a turn, should it finish after its
/// window was dropped, is stored in the main database instead, so this only keeps
/// that rare case rarer.
const MINT_MARGIN_MS: u64 = 1_000;

/// The windows that can be dropped whole: not the newest (which takes new turns),
/// ended more than [`MINT_MARGIN_MS`] ago by the wall clock that mints turn ids, with
/// no folded record left (every turn of it expired and deleted) and no unfinished
/// turn minted in it.
fn empty_windows(store: &Store, wall_ms: u64) -> Result<Vec<u64>, StoreError> {
    let kv = store.kv();
    let mut out = Vec::new();
    for w in kv.windows()? {
        let Some(end) = w.end_ms else { continue };
        if w.dropped || end.saturating_add(MINT_MARGIN_MS) > wall_ms {
            continue;
        }
        let (fs, fe) = windows::finished_key_range(w.start_ms, Some(end));
        let (ts, te) = windows::turn_key_range(w.start_ms, Some(end));
        // Unfinished turns first: a turn that finishes between the two reads moves from
        // the second range into the first, and is seen there. (One that finishes after
        // them is moved to the main database when the drop is taken.)
        if kv.scan(&ts, &te, false, 1)?.is_empty() && kv.scan(&fs, &fe, false, 1)?.is_empty() {
            out.push(w.start_ms);
        }
    }
    Ok(out)
}

/// Deletes of the invocation records of `early` whose turns are gone and that are
/// still there.
fn stale_invocations(store: &Store, early: &Early) -> Result<Batch, StoreError> {
    let mut b = Batch::new();
    for (turn_id, ks) in early {
        if store.turn_exists(turn_id)? {
            continue;
        }
        for k in ks {
            if store.kv().get(k)?.is_some() {
                b.delete(k.clone());
            }
        }
    }
    Ok(b)
}

/// Event values read per page of a window's rescue.
const RESCUE_PAGE: usize = 512;

/// The writes that keep, before the window starting at `start` is dropped, the events
/// it holds of turns still stored. An event value is stored in the window of the
/// newest turn among its events, and retention leaves a deleted turn's values to its
/// window's drop; so a value of a turn the window is dropped for can also hold events
/// of an older turn, of an older window, that is still stored (one that was running
/// while the newer one was queued, and ended after it). Such a value is written again
/// with those events only, routed by the newest of their turns, out of this window.
/// The window holds no stored turn of its own by now ([`empty_windows`]), so every
/// value in it holds events of turns that are gone.
fn rescue(store: &Store, start: u64) -> Result<Batch, StoreError> {
    let mut b = Batch::new();
    let mut stored: HashMap<String, bool> = HashMap::new();
    let (mut from, end) = (vec![b'E'], vec![b'E' + 1]);
    loop {
        let page = store.kv().scan_window(start, &from, &end, RESCUE_PAGE)?;
        for (_, v) in &page {
            let mut kept = Vec::new();
            for e in turnd_store::event_value(v)? {
                let keep = match stored.get(&e.turn_id) {
                    Some(k) => *k,
                    None => {
                        let k = store.turn_exists(&e.turn_id)?;
                        stored.insert(e.turn_id.clone(), k);
                        k
                    }
                };
                if keep {
                    kept.push(e);
                }
            }
            b.put_events_in(&kept, true);
        }
        if page.len() < RESCUE_PAGE {
            return Ok(b);
        }
        match page.last() {
            Some((k, _)) => {
                from = k.clone();
                from.push(0);
            }
            None => return Ok(b),
        }
    }
}

/// A hold on merging a session's event values in the store, released when dropped
/// (on every way out of a sweep of the session).
struct MergeHold<'a> {
    kv: &'a Arc<dyn turnd_store::Kv>,
    session_id: &'a str,
}

impl<'a> MergeHold<'a> {
    fn new(kv: &'a Arc<dyn turnd_store::Kv>, session_id: &'a str) -> MergeHold<'a> {
        kv.hold_event_merges(session_id);
        MergeHold { kv, session_id }
    }
}

impl Drop for MergeHold<'_> {
    fn drop(&mut self) {
        self.kv.release_event_merges(self.session_id);
    }
}

fn total(c: &TurnCounts) -> u64 {
    c.queued + c.running + c.completed + c.failed + c.cancelled
}

/// What [`delete_turns`] found: the turns deleted, their statuses, and the
/// invocations folded into their records (whose own keys are gone already).
struct Deleted {
    gone: HashSet<String>,
    statuses: Vec<TurnStatus>,
    folded: HashSet<String>,
    /// Every one's list entry and event values are left to its window's drop.
    all_left: bool,
    /// Some one's are.
    any_left: bool,
}

/// The keys of the expired turns' places in the session's turn list, as stored (with
/// a route, or without one when written before routes), read in one scan.
fn list_keys(
    store: &Store,
    s: SessionKeys<'_>,
    expired: &[Expired],
) -> Result<HashMap<u64, Vec<u8>>, StoreError> {
    let (Some(first), Some(last)) = (
        expired.iter().map(|t| t.seq).min(),
        expired.iter().map(|t| t.seq).max(),
    ) else {
        return Ok(HashMap::new());
    };
    let wanted: HashMap<u64, &str> = expired
        .iter()
        .map(|t| (t.seq, t.turn_id.as_str()))
        .collect();
    Ok(store
        .list_entries(s, first, last.saturating_add(1), false, usize::MAX)?
        .into_iter()
        .filter(|(_, seq, id)| wanted.get(seq) == Some(&id.as_str()))
        .map(|(k, seq, _)| (seq, k))
        .collect())
}

/// The open time windows: what a window's drop will take.
struct Open(Vec<WindowInfo>);

impl Open {
    fn read(store: &Store) -> Result<Open, StoreError> {
        Ok(Open(
            store
                .kv()
                .windows()?
                .into_iter()
                .filter(|w| !w.dropped)
                .collect(),
        ))
    }

    /// Whether the keys routed at `ms` are in an open window (a turn's folded record,
    /// list entry and idempotency key by its id's time).
    fn holds(&self, ms: Option<u64>) -> bool {
        ms.is_some_and(|ms| {
            self.0
                .iter()
                .any(|w| w.start_ms <= ms && w.end_ms.is_none_or(|e| ms < e))
        })
    }
}

/// Whether an expired turn's list entry and event values are left for its window's
/// drop: its record is folded (the current layout), its keys are in an open window,
/// and it comes before the session's first unfinished turn (`active_from`), where
/// recovery reads the turn list from (an entry of a deleted turn there would name no
/// turn).
fn left_to_window(t: &Expired, open: &Open, active_from: Option<u64>) -> bool {
    t.folded.is_some()
        && open.holds(keys::route_of(&t.turn_id))
        && active_from.is_none_or(|a| t.seq < a)
}

/// The deletes of the expired turns' own keys: their records, their idempotency keys
/// (while these still name them), their last invocations (unless folded into their
/// records) and their places in the session's turn list, unless left to their
/// window's drop ([`left_to_window`]).
fn delete_turns(
    store: &Store,
    s: SessionKeys<'_>,
    expired: Vec<Expired>,
    at: &Planned,
    b: &mut Batch,
) -> Result<Deleted, StoreError> {
    let (open, active_from) = (&*at.open, at.active_from);
    let mut gone: HashSet<String> = HashSet::new();
    let mut statuses = Vec::new();
    let mut folded_invs: HashSet<String> = HashSet::new();
    let (left, deleted): (Vec<Expired>, Vec<Expired>) = expired
        .into_iter()
        .partition(|t| left_to_window(t, open, active_from));
    let mut listed = list_keys(store, s, &deleted)?;
    let all_left = deleted.is_empty();
    let any_left = !left.is_empty();
    for t in deleted.into_iter().chain(left) {
        b.delete(keys::finished(&t.turn_id));
        if t.folded.is_none() {
            b.delete(keys::turn(&t.turn_id));
            b.delete(keys::turn_input(&t.turn_id));
        }
        if let Some(k) = listed.remove(&t.seq) {
            b.delete(k);
        }
        if let Some(k) = &t.idempotency_key {
            if let Some((key, r)) = store.idempotency_entry(s, k)? {
                if r.turn_id == t.turn_id {
                    b.delete(key);
                }
            }
        }
        folded_invs.extend(t.folded.into_iter().flatten());
        // Its earlier steps' and attempts' invocations (its last one is below).
        for k in at.early.get(&t.turn_id).into_iter().flatten() {
            if k.get(1..) != t.invocation_id.as_deref().map(str::as_bytes) {
                b.delete(k.clone());
            }
        }
        if let Some(inv) = &t.invocation_id {
            if !folded_invs.contains(inv) {
                b.delete(keys::invocation(inv));
            }
        }
        statuses.push(t.status);
        gone.insert(t.turn_id);
    }
    Ok(Deleted {
        gone,
        statuses,
        folded: folded_invs,
        all_left,
        any_left,
    })
}

/// Read what deleting `expired` of session `sid` writes (see the module doc).
/// `counts` are the session's counts when the reads began: when the deleted turns
/// are all of them, every event value is read, to forget the session.
fn plan(
    store: &Store,
    s: SessionKeys<'_>,
    expired: Vec<Expired>,
    cutoff: u64,
    at: &Planned,
) -> Result<Plan, StoreError> {
    let mut b = Batch::new();
    let Deleted {
        gone,
        statuses,
        folded,
        all_left,
        any_left,
    } = delete_turns(store, s, expired, at, &mut b)?;
    let read_all = total(&at.counts) <= gone.len() as u64;
    let mut all_values = read_all.then(Vec::new);
    // The turns' events are read out of stored values only when one of them is not
    // left to its window (or to forget the session); a turn that is has its events
    // passed over by reads once its record is gone (`Store::events`).
    // The session's stored entries and events may name turns that are gone from now
    // on (`store.check` reads it).
    let mut pruned = any_left;
    if all_left && !read_all {
        return Ok(Plan {
            batch: b,
            gone,
            statuses,
            pruned,
            all_values: None,
            all_entries: None,
        });
    }

    pruned |= prune_events(
        store,
        s,
        cutoff,
        &gone,
        &folded,
        all_values.as_mut(),
        &mut b,
    )?;
    let all_entries = if read_all {
        Some(all_list_keys(store, s)?)
    } else {
        None
    };
    Ok(Plan {
        batch: b,
        gone,
        statuses,
        pruned,
        all_values,
        all_entries,
    })
}

/// The writes that take the events of the turns in `gone` out of the session's stored
/// event values, up to the first value written after the cutoff (every value when
/// `all_values` is given, whose keys it collects: the session is expected to be
/// forgotten), with the invocations their `dispatched` events name (unless folded
/// into their records). Whether it took any event out.
fn prune_events(
    store: &Store,
    s: SessionKeys<'_>,
    cutoff: u64,
    gone: &HashSet<String>,
    folded: &HashSet<String>,
    mut all_values: Option<&mut Vec<Vec<u8>>>,
    b: &mut Batch,
) -> Result<bool, StoreError> {
    // Events: up to the first value written after the cutoff (all of them when the
    // session is expected to be forgotten).
    let mut exists: HashMap<String, bool> = HashMap::new();
    let mut is_gone = |e: &Event| -> Result<bool, StoreError> {
        if gone.contains(&e.turn_id) {
            return Ok(true);
        }
        if let Some(known) = exists.get(&e.turn_id) {
            return Ok(!known);
        }
        // A turn that still has its record remains (unfinished turns have theirs
        // from admission on); one without is gone since an earlier sweep.
        let found = store.turn_exists(&e.turn_id)?;
        exists.insert(e.turn_id.clone(), found);
        Ok(!found)
    };
    let mut pruned = false;
    let mut from: Option<Vec<u8>> = None;
    'scan: loop {
        let (values, next) = store.event_values_page(s, from.as_deref(), EVENT_PAGE)?;
        for (key, events) in values {
            if events.first().is_some_and(|e| e.at_ms > cutoff) {
                match all_values.as_deref_mut() {
                    Some(all) => {
                        all.push(key);
                        continue;
                    }
                    None => break 'scan,
                }
            }
            if let Some(all) = all_values.as_deref_mut() {
                all.push(key.clone());
            }
            let mut dead = Vec::new();
            let mut kept = Vec::new();
            for e in events {
                if is_gone(&e)? {
                    dead.push(e);
                } else {
                    kept.push(e);
                }
            }
            if dead.is_empty() {
                continue;
            }
            for e in &dead {
                if e.kind == EventKind::Dispatched {
                    if let Some(inv) = e.detail.get("invocation_id").and_then(Value::as_str) {
                        if !folded.contains(inv) {
                            b.delete(keys::invocation(inv));
                        }
                    }
                }
            }
            pruned = true;
            // Keyed by the last kept event and routed by the newest turn kept (a value
            // written before routes is written again without one); written after the
            // delete, so it wins when that is the same key.
            let routed = keys::session_route(&key).is_some();
            b.delete(key);
            b.put_events_in(&kept, routed);
        }
        match next {
            Some(n) => from = Some(n),
            None => break,
        }
    }
    Ok(pruned)
}

/// Keys of every entry of a session's turn list (a session being forgotten: entries
/// of turns deleted earlier may be left to their windows' drops).
fn all_list_keys(store: &Store, s: SessionKeys<'_>) -> Result<Vec<Vec<u8>>, StoreError> {
    Ok(store
        .list_entries(s, 0, u64::MAX, false, usize::MAX)?
        .into_iter()
        .map(|(k, _, _)| k)
        .collect())
}

/// Counts less the deleted turns of `statuses`.
fn uncount(counts: &mut TurnCounts, statuses: &[TurnStatus]) {
    for s in statuses {
        let c = counts.get_mut(*s);
        *c = c.saturating_sub(1);
    }
}

/// Deletes of every stored event value of `sid` (a session being forgotten).
fn delete_all_events(store: &Store, s: SessionKeys<'_>, b: &mut Batch) -> Result<(), StoreError> {
    let mut from: Option<Vec<u8>> = None;
    loop {
        let (values, next) = store.event_values_page(s, from.as_deref(), EVENT_PAGE)?;
        for (key, _) in values {
            b.delete(key);
        }
        match next {
            Some(n) => from = Some(n),
            None => return Ok(()),
        }
    }
}

/// Whether an event of `sid` after `after` is about one of the turns in `gone`.
fn touched(
    store: &Store,
    s: SessionKeys<'_>,
    after: u64,
    gone: &HashSet<String>,
) -> Result<bool, StoreError> {
    Ok(store
        .events(s, after, usize::MAX)?
        .iter()
        .any(|e| gone.contains(&e.turn_id)))
}

impl Engine {
    /// Start the sweep task (nothing when retention is off).
    pub(super) fn spawn_retention(&self) {
        let cfg = &self.inner.cfg;
        if cfg.retention_terminal_ms == 0 {
            return;
        }
        let every = Duration::from_millis(cfg.retention_sweep_interval_ms.max(1));
        self.every(every, |engine| async move {
            match engine.sweep().await {
                Ok(0) => {}
                Ok(n) => tracing::debug!("retention deleted {n} terminal turns"),
                Err(e) => {
                    tracing::warn!("retention sweep failed (tried again at the next one): {e}")
                }
            }
        });
    }

    /// One sweep: delete every terminal turn that finished `retention_terminal_ms` or
    /// more ago. Returns how many turns it deleted.
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let keep = self.inner.cfg.retention_terminal_ms;
        if keep == 0 {
            return Ok(0);
        }
        let cutoff = self.now_ms().saturating_sub(keep);
        let mut from = Store::FIRST.to_vec();
        let mut deleted = 0;
        // Only this task drops windows, after the deletions: the open ones stay open
        // while it deletes.
        let store = self.inner.store.clone();
        let open = Arc::new(off_runtime(move || Open::read(&store)).await?);
        let store = self.inner.store.clone();
        // Invocation ids carry the wall clock's time of their dispatch, and the
        // engine's clock may have drifted from it since the start: the later bound.
        let minted = windows::now_ms().saturating_sub(keep).max(cutoff);
        let early = Arc::new(off_runtime(move || early_invocations(&store, minted)).await?);
        loop {
            let store = self.inner.store.clone();
            let (by_session, next) = off_runtime(move || gather(&store, from, cutoff)).await?;
            // Sessions at once: each waits for its lock (behind the session's own
            // transitions) and for a durable commit, which many share.
            let mut running = tokio::task::JoinSet::new();
            let mut failed = None;
            let mut join = |r: Result<Result<u64, StoreError>, tokio::task::JoinError>| match r {
                Ok(Ok(n)) => deleted += n,
                Ok(Err(e)) => {
                    failed.get_or_insert(e);
                }
                Err(e) => {
                    failed.get_or_insert(StoreError::Write(format!("retention task: {e}")));
                }
            };
            for (sid, turns) in by_session {
                while running.len() >= SESSIONS_AT_ONCE {
                    if let Some(r) = running.join_next().await {
                        join(r);
                    }
                }
                self.hold_back().await;
                let engine = self.clone();
                let (open, early) = (open.clone(), early.clone());
                running.spawn(async move { engine.expire(&sid, turns, cutoff, open, early).await });
            }
            while let Some(r) = running.join_next().await {
                join(r);
            }
            if let Some(e) = failed {
                return Err(e);
            }
            match next {
                Some(n) => from = n,
                None => break,
            }
        }
        // Invocations of turns that are gone by other ways (deleted key by key, whose
        // events named them) or were left behind: deleted when still there.
        let store = self.inner.store.clone();
        let stale = off_runtime(move || stale_invocations(&store, &early)).await?;
        if !stale.is_empty() {
            self.inner.store.commit(stale).await?;
        }
        let store = self.inner.store.clone();
        for start in off_runtime(move || empty_windows(&store, windows::now_ms())).await? {
            let store = self.inner.store.clone();
            let mut b = off_runtime(move || rescue(&store, start)).await?;
            b.drop_window(start);
            self.inner.store.commit(b).await?;
            self.inner
                .counters
                .windows_dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::debug!("dropped the time window starting at {start}");
        }
        Ok(deleted)
    }

    /// Wait while the store is behind, at most [`HOLD_BACK_MAX`]: retention's deletes
    /// then wait rather than fill the room that live commits need.
    async fn hold_back(&self) {
        let until = tokio::time::Instant::now() + HOLD_BACK_MAX;
        while self.inner.store.kv().busy() && tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// Lock the session once no event after `seen` is about a turn of `gone` (checked
    /// without the lock, a few times, then under it). None: one is, the session is
    /// left to the next sweep (a late result changed one of them).
    async fn lock_untouched<'a>(
        &self,
        cell: &'a Arc<SessionCell>,
        sid: &str,
        mut seen: u64,
        gone: &Arc<HashSet<String>>,
    ) -> Result<Option<tokio::sync::MutexGuard<'a, super::SessionState>>, StoreError> {
        let mut rechecks = 0;
        loop {
            let st = self.lock(cell).await?;
            let now = st.meta.last_event_seq;
            if now == seen {
                return Ok(Some(st));
            }
            if rechecks == RECHECKS {
                if touched(&self.inner.store, st.meta.keys(), seen, gone)? {
                    return Ok(None);
                }
                return Ok(Some(st));
            }
            let from_ms = st.meta.routed_from_ms;
            drop(st);
            rechecks += 1;
            let (store, owned_sid, g) = (self.inner.store.clone(), sid.to_string(), gone.clone());
            let s = move || {
                let keys = SessionKeys {
                    id: &owned_sid,
                    from_ms,
                };
                touched(&store, keys, seen, &g)
            };
            if off_runtime(s).await? {
                return Ok(None);
            }
            seen = now;
        }
    }

    /// Delete the expired turns of one session (see the module doc). The store keeps
    /// the session's event values under their keys meanwhile
    /// ([`turnd_store::Kv::hold_event_merges`]): the plan reads them and writes them
    /// again under those keys.
    async fn expire(
        &self,
        sid: &str,
        expired: Vec<Expired>,
        cutoff: u64,
        open: Arc<Open>,
        early: Arc<Early>,
    ) -> Result<u64, StoreError> {
        let _hold = MergeHold::new(self.inner.store.kv(), sid);
        let cell = self.cell(sid);
        let (planned_at, at, from_ms) = {
            let st = self.lock(&cell).await?;
            let m = &st.meta;
            let at = Planned {
                counts: m.counts.clone(),
                active_from: m.active_from,
                open,
                early,
            };
            (m.last_event_seq, at, m.routed_from_ms)
        };
        let store = self.inner.store.clone();
        let owned_sid = sid.to_string();
        let plan = off_runtime(move || {
            let s = SessionKeys {
                id: &owned_sid,
                from_ms,
            };
            plan(&store, s, expired, cutoff, &at)
        })
        .await?;
        if plan.gone.is_empty() {
            return Ok(0);
        }
        let gone = Arc::new(plan.gone);

        // Under the lock only if nothing touched the turns since the reads.
        let Some(mut st) = self.lock_untouched(&cell, sid, planned_at, &gone).await? else {
            return Ok(0);
        };

        let mut b = plan.batch;
        let mut counts = st.meta.counts.clone();
        uncount(&mut counts, &plan.statuses);
        let forget = total(&counts) == 0
            && st.active.len() == 0
            && st.pending.is_none()
            && st.timer.is_none()
            && !self.watched(sid);
        if forget {
            match (plan.all_values, plan.all_entries) {
                // Read when the counts were what they are now (the last event seq
                // did not move since), so these are all of them.
                (Some(values), Some(entries)) if planned_at == st.meta.last_event_seq => {
                    for k in values.into_iter().chain(entries) {
                        b.delete(k);
                    }
                }
                _ => {
                    delete_all_events(&self.inner.store, st.meta.keys(), &mut b)?;
                    for k in all_list_keys(&self.inner.store, st.meta.keys())? {
                        b.delete(k);
                    }
                }
            }
            b.delete(keys::session_meta(sid));
        } else {
            let mut meta = st.meta.clone();
            meta.counts = counts.clone();
            meta.events_pruned |= plan.pruned;
            b.put_session_meta(&meta);
        }
        self.inner.store.commit(b).await?;
        self.inner
            .counters
            .turns_expired
            .fetch_add(gone.len() as u64, std::sync::atomic::Ordering::Relaxed);

        if forget {
            st.meta = SessionMeta::new(sid);
        } else {
            st.meta.counts = counts;
            st.meta.events_pruned |= plan.pruned;
        }
        uncount(&mut self.inner.counts.lock(), &plan.statuses);
        drop(st);
        if forget {
            self.evict(sid, &cell);
        }
        Ok(gone.len() as u64)
    }

    fn watched(&self, sid: &str) -> bool {
        self.inner
            .watches
            .lock()
            .get(sid)
            .is_some_and(|v| !v.is_empty())
    }

    /// Drop a forgotten session's cell from memory, unless someone else holds it
    /// (they would go on with a cell the map no longer knows while a new one could be
    /// made for the same session). The check and the removal happen under the map's
    /// lock, under which every other holder got its reference.
    fn evict(&self, sid: &str, cell: &Arc<SessionCell>) {
        let mut m = self.inner.sessions.lock();
        let ours = m.get(sid).is_some_and(|c| Arc::ptr_eq(c, cell));
        // The map's reference and the caller's.
        if ours && Arc::strong_count(cell) == 2 {
            m.remove(sid);
        }
    }
}

#[cfg(test)]
mod tests;
