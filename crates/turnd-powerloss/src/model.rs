//! A journal read as a history of changes to identified files and directories, and
//! which of them a power loss at a given point may take away.
//!
//! [`Model::build`] walks the journal forward once. It gives every inode an identity
//! ([`Uid`]): a new one at each creation (a removed directory's inode number may come
//! back for another), and one at first sight for what existed before the recording.
//! It turns each entry into an [`Op`] on identities, and checks the sizes the entries
//! report against the sizes the recorded changes imply: a file that grew without a
//! recorded call (a `fallocate` made with a raw system call, which no `LD_PRELOAD`
//! library sees) gets a [`Op::SetLen`] of its own, placed where the growth was first
//! seen, so that it is undone like any other unsynced change. A shrink that nothing
//! recorded cannot be undone and is reported as unmodeled.
//!
//! **Durability at a point.** A crash at point `p` (after `ops[..p]`, before
//! `ops[p]`) keeps for good, on a disk that honours its flushes (the model of Linux's
//! `fsync(2)`): for a file, every change made before the start of the last sync of it
//! that returned successfully before `p`; for a directory, likewise every entry
//! created, removed or renamed in it. An `fsync` of a file does not make its name
//! durable, nor does a directory's sync its files' data. Everything else since is
//! *pending*: [`Model::pending`] lists it, and a test may also have a sync *lie*
//! (counted as never done), which models a disk that drops a flush.

use std::collections::{BTreeMap, HashMap};

use crate::journal::{Entry, Old, Record};

/// The identity of a file or directory across a recording.
pub type Uid = usize;

/// One recorded change or sync, on identities (see [`Entry`] for each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Write {
        file: Uid,
        off: u64,
        len: u64,
        old_size: u64,
        old: Old,
    },
    SetLen {
        file: Uid,
        old_size: u64,
        new_size: u64,
        tail: Old,
    },
    Create {
        dir: Uid,
        name: Vec<u8>,
        node: Uid,
    },
    Mkdir {
        dir: Uid,
        name: Vec<u8>,
        node: Uid,
    },
    Unlink {
        dir: Uid,
        name: Vec<u8>,
        node: Uid,
    },
    Rmdir {
        dir: Uid,
        name: Vec<u8>,
        node: Uid,
    },
    Rename {
        dir: Uid,
        from: Vec<u8>,
        to: Vec<u8>,
        node: Uid,
        replaced: Option<Uid>,
    },
    /// A sync of `target` began (its end is [`Op::SyncEnd`] with the same id).
    Sync {
        target: Uid,
        id: u64,
        data_only: bool,
        path: Vec<u8>,
    },
    SyncEnd {
        id: u64,
        ok: bool,
    },
    Cut,
    Unmodeled(String),
}

impl Op {
    /// The file whose data this changes.
    pub fn data_of(&self) -> Option<Uid> {
        match self {
            Op::Write { file, .. } | Op::SetLen { file, .. } => Some(*file),
            _ => None,
        }
    }

    /// The directory whose entries this changes.
    pub fn dir_of(&self) -> Option<Uid> {
        match self {
            Op::Create { dir, .. }
            | Op::Mkdir { dir, .. }
            | Op::Unlink { dir, .. }
            | Op::Rmdir { dir, .. }
            | Op::Rename { dir, .. } => Some(*dir),
            _ => None,
        }
    }
}

/// A recording as a history of [`Op`]s.
#[derive(Debug, Default)]
pub struct Model {
    /// The changes and syncs in order, each with the time of its journal entry (an
    /// op found by its size is given the time of the entry before it: the earliest
    /// moment it can have happened).
    pub ops: Vec<(u64, Op)>,
    /// Uids given so far.
    uids: usize,
    /// The identity each inode number has now.
    live: HashMap<u64, Uid>,
    /// Stash number → the identity of the inode kept there.
    pub stashed: BTreeMap<u64, Uid>,
    /// Identities of directories.
    pub dirs: std::collections::HashSet<Uid>,
    /// A file's size as the recorded changes leave it, once known.
    sizes: HashMap<Uid, u64>,
    /// Sync id → index of its [`Op::Sync`] and of its [`Op::SyncEnd`].
    syncs: HashMap<u64, (usize, Option<usize>)>,
    /// The journal's last frame was cut short.
    pub torn_tail: bool,
}

impl Model {
    /// Read `records` forward (see the module documentation).
    pub fn build(records: &[Record], torn_tail: bool) -> Model {
        let mut m = Model {
            torn_tail,
            ..Model::default()
        };
        let mut last_t = 0;
        for r in records {
            m.add(r, last_t);
            last_t = r.t_ns;
        }
        m
    }

    fn fresh(&mut self, ino: u64) -> Uid {
        let uid = self.uids;
        self.uids += 1;
        self.live.insert(ino, uid);
        uid
    }

    /// The identity inode `ino` has now (a new one at first sight).
    pub fn uid(&mut self, ino: u64) -> Uid {
        match self.live.get(&ino) {
            Some(u) => *u,
            None => self.fresh(ino),
        }
    }

    /// The identity inode `ino` has now, if the recording saw it.
    pub fn known(&self, ino: u64) -> Option<Uid> {
        self.live.get(&ino).copied()
    }

    fn push(&mut self, t: u64, op: Op) {
        self.ops.push((t, op));
    }

    /// Note that `file` was `size` long just before the entry at time `t`: a size the
    /// recorded changes do not explain is an unrecorded change (see the module
    /// documentation), added as an op before it.
    fn size_seen(&mut self, file: Uid, size: u64, before_t: u64) {
        if let Some(&expected) = self.sizes.get(&file) {
            if size > expected {
                self.push(
                    before_t,
                    Op::SetLen {
                        file,
                        old_size: expected,
                        new_size: size,
                        tail: Old::Zeros(0),
                    },
                );
            } else if size < expected {
                self.push(
                    before_t,
                    Op::Unmodeled(format!(
                        "file #{file} shrank from {expected} to {size} bytes without a recorded call"
                    )),
                );
            }
        }
        self.sizes.insert(file, size);
    }

    /// A file's size at the end of the recording was `size`: see [`Model::size_seen`].
    pub fn final_size(&mut self, file: Uid, size: u64) {
        let t = self.ops.last().map_or(0, |(t, _)| *t);
        self.size_seen(file, size, t);
    }

    fn add(&mut self, r: &Record, before_t: u64) {
        let t = r.t_ns;
        let op = match &r.entry {
            Entry::Write {
                ino,
                off,
                len,
                old_size,
                old,
            } => {
                let file = self.uid(*ino);
                self.size_seen(file, *old_size, before_t);
                self.sizes.insert(file, (*old_size).max(off + len));
                Op::Write {
                    file,
                    off: *off,
                    len: *len,
                    old_size: *old_size,
                    old: old.clone(),
                }
            }
            Entry::SetLen {
                ino,
                old_size,
                new_size,
                tail,
            } => {
                let file = self.uid(*ino);
                self.size_seen(file, *old_size, before_t);
                self.sizes.insert(file, *new_size);
                Op::SetLen {
                    file,
                    old_size: *old_size,
                    new_size: *new_size,
                    tail: tail.clone(),
                }
            }
            Entry::SyncBegin {
                ino,
                id,
                data_only,
                dir,
                size,
                path,
            } => {
                let target = self.uid(*ino);
                if *dir {
                    self.dirs.insert(target);
                } else {
                    self.size_seen(target, *size, before_t);
                }
                self.syncs.insert(*id, (self.ops.len(), None));
                Op::Sync {
                    target,
                    id: *id,
                    data_only: *data_only,
                    path: path.clone(),
                }
            }
            Entry::SyncEnd { id, ok } => {
                if let Some(s) = self.syncs.get_mut(id) {
                    s.1 = Some(self.ops.len());
                }
                Op::SyncEnd { id: *id, ok: *ok }
            }
            _ => self.namespace(&r.entry),
        };
        self.push(t, op);
    }

    /// The op of a namespace entry (or of [`Entry::Unmodeled`], [`Entry::Cut`]).
    fn namespace(&mut self, entry: &Entry) -> Op {
        match entry {
            Entry::Create { parent, name, ino } | Entry::Mkdir { parent, name, ino } => {
                let dir = self.uid(*parent);
                self.dirs.insert(dir);
                let node = self.fresh(*ino);
                if matches!(entry, Entry::Mkdir { .. }) {
                    self.dirs.insert(node);
                    Op::Mkdir {
                        dir,
                        name: name.clone(),
                        node,
                    }
                } else {
                    self.sizes.insert(node, 0);
                    Op::Create {
                        dir,
                        name: name.clone(),
                        node,
                    }
                }
            }
            Entry::Unlink {
                parent,
                name,
                ino,
                stash,
            } => {
                let dir = self.uid(*parent);
                let node = self.uid(*ino);
                self.stashed.insert(*stash, node);
                Op::Unlink {
                    dir,
                    name: name.clone(),
                    node,
                }
            }
            Entry::Rmdir { parent, name, ino } => {
                let dir = self.uid(*parent);
                let node = self.uid(*ino);
                self.dirs.insert(node);
                // The inode number is free again.
                self.live.remove(ino);
                Op::Rmdir {
                    dir,
                    name: name.clone(),
                    node,
                }
            }
            Entry::Rename {
                parent,
                from,
                to,
                ino,
                replaced,
            } => {
                let dir = self.uid(*parent);
                let node = self.uid(*ino);
                let replaced = replaced.map(|(r_ino, stash)| {
                    let r = self.uid(r_ino);
                    self.stashed.insert(stash, r);
                    r
                });
                Op::Rename {
                    dir,
                    from: from.clone(),
                    to: to.clone(),
                    node,
                    replaced,
                }
            }
            Entry::Cut => Op::Cut,
            Entry::Unmodeled { what } => Op::Unmodeled(what.clone()),
            Entry::Write { .. }
            | Entry::SetLen { .. }
            | Entry::SyncBegin { .. }
            | Entry::SyncEnd { .. } => Op::Unmodeled("misrouted entry".into()),
        }
    }

    /// Every index of an [`Op::Sync`]: the points just before each sync began.
    pub fn sync_points(&self) -> Vec<usize> {
        self.ops
            .iter()
            .enumerate()
            .filter(|(_, (_, op))| matches!(op, Op::Sync { .. }))
            .map(|(i, _)| i)
            .collect()
    }

    /// Whether the sync that began at `begin` had returned successfully before
    /// point `p`.
    fn completed(&self, begin: usize, p: usize) -> bool {
        let Some((_, Op::Sync { id, .. })) = self.ops.get(begin) else {
            return false;
        };
        match self.syncs.get(id) {
            Some((_, Some(end))) if *end < p => {
                matches!(self.ops.get(*end), Some((_, Op::SyncEnd { ok: true, .. })))
            }
            _ => false,
        }
    }

    /// The ops before `p` that a power loss at `p` may take away, in order: changes
    /// to a file's data or a directory's entries made after the start of the last
    /// sync of it that had returned successfully by `p`, counting a sync for which
    /// `lie(model, index)` holds as never done.
    pub fn pending(&self, p: usize, lie: &dyn Fn(&Model, usize) -> bool) -> Vec<usize> {
        let mut durable_before: HashMap<Uid, usize> = HashMap::new();
        for (i, (_, op)) in self.ops.iter().enumerate().take(p) {
            if let Op::Sync { target, .. } = op {
                if self.completed(i, p) && !lie(self, i) {
                    durable_before.insert(*target, i);
                }
            }
        }
        self.ops
            .iter()
            .enumerate()
            .take(p)
            .filter(|(i, (_, op))| {
                op.data_of()
                    .or_else(|| op.dir_of())
                    .is_some_and(|u| durable_before.get(&u).is_none_or(|b| b < i))
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// Descriptions of the [`Op::Unmodeled`] ops.
    pub fn unmodeled(&self) -> Vec<String> {
        self.ops
            .iter()
            .filter_map(|(_, op)| match op {
                Op::Unmodeled(w) => Some(w.clone()),
                _ => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(t: u64, entry: Entry) -> Record {
        Record { t_ns: t, entry }
    }

    fn write(ino: u64, off: u64, len: u64, old_size: u64) -> Entry {
        Entry::Write {
            ino,
            off,
            len,
            old_size,
            old: Old::Zeros(old_size.saturating_sub(off).min(len)),
        }
    }

    fn sync(ino: u64, id: u64, size: u64) -> Entry {
        Entry::SyncBegin {
            ino,
            id,
            data_only: true,
            dir: false,
            size,
            path: vec![],
        }
    }

    #[test]
    fn writes_are_pending_until_a_sync_of_their_file_returns() {
        let m = Model::build(
            &[
                rec(1, write(10, 0, 5, 0)),
                rec(2, sync(10, 1, 5)),
                rec(3, write(10, 5, 5, 5)),
                rec(4, Entry::SyncEnd { id: 1, ok: true }),
                rec(5, write(11, 0, 5, 0)),
            ],
            false,
        );
        let honest = |_: &Model, _: usize| false;
        // Before the sync returned: everything pending.
        assert_eq!(m.pending(3, &honest), vec![0, 2]);
        // After: the write made while it ran is still pending, the other file's too.
        assert_eq!(m.pending(5, &honest), vec![2, 4]);
        // A sync that lies keeps the first write pending.
        assert_eq!(m.pending(5, &|_: &Model, i| i == 1), vec![0, 2, 4]);
        // A failed sync makes nothing durable.
        let failed = Model::build(
            &[
                rec(1, write(10, 0, 5, 0)),
                rec(2, sync(10, 1, 5)),
                rec(3, Entry::SyncEnd { id: 1, ok: false }),
            ],
            false,
        );
        assert_eq!(failed.pending(3, &honest), vec![0]);
    }

    #[test]
    fn names_wait_for_their_directory_and_data_for_its_file() {
        let m = Model::build(
            &[
                rec(
                    1,
                    Entry::Create {
                        parent: 1,
                        name: b"f".to_vec(),
                        ino: 10,
                    },
                ),
                rec(2, write(10, 0, 5, 0)),
                rec(3, sync(10, 1, 5)),
                rec(4, Entry::SyncEnd { id: 1, ok: true }),
            ],
            false,
        );
        // The file's data is durable, its name is not.
        assert_eq!(m.pending(4, &|_: &Model, _| false), vec![0]);
    }

    #[test]
    fn a_growth_nothing_recorded_becomes_an_op_and_a_shrink_is_unmodeled() {
        let mut m = Model::build(
            &[
                rec(
                    1,
                    Entry::Create {
                        parent: 1,
                        name: b"seg".to_vec(),
                        ino: 10,
                    },
                ),
                // fallocate(0, 64 KiB) by a raw system call, then the sync sees it.
                rec(5, sync(10, 1, 65536)),
                rec(6, Entry::SyncEnd { id: 1, ok: true }),
            ],
            false,
        );
        assert_eq!(
            m.ops[1],
            (
                1,
                Op::SetLen {
                    file: 1,
                    old_size: 0,
                    new_size: 65536,
                    tail: Old::Zeros(0)
                }
            )
        );
        assert!(matches!(m.ops[2].1, Op::Sync { .. }));
        m.final_size(1, 10);
        assert_eq!(m.unmodeled().len(), 1, "{:?}", m.ops);
    }

    #[test]
    fn a_removed_directory_s_inode_number_gets_a_new_identity_when_reused() {
        let m = Model::build(
            &[
                rec(
                    1,
                    Entry::Mkdir {
                        parent: 1,
                        name: b"a".to_vec(),
                        ino: 20,
                    },
                ),
                rec(
                    2,
                    Entry::Rmdir {
                        parent: 1,
                        name: b"a".to_vec(),
                        ino: 20,
                    },
                ),
                rec(
                    3,
                    Entry::Mkdir {
                        parent: 1,
                        name: b"b".to_vec(),
                        ino: 20,
                    },
                ),
            ],
            false,
        );
        let node = |i: usize| match &m.ops[i].1 {
            Op::Mkdir { node, .. } | Op::Rmdir { node, .. } => *node,
            op => panic!("{op:?}"),
        };
        assert_eq!(node(0), node(1));
        assert_ne!(node(0), node(2));
    }
}
