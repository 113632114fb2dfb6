//! The disk states a power loss may leave, made on disk from a recording.
//!
//! [`Recording::open`] copies the recorded root as the process left it (and the
//! recorder's stash of inodes whose names were removed) into a work directory,
//! `tree/` and `limbo/`: a file or directory without a name in the tree waits in
//! `limbo/<uid>`, so that undoing a removal or redoing a creation is a rename. Every
//! op has an inverse made from what the journal kept (the bytes a write replaced, a
//! removed name's inode from the stash), so the work directory can be taken back to
//! the moment before any op: [`Recording::rewind`], in decreasing points, as ALICE
//! and CrashMonkey take a recorded run back to each crash point.
//!
//! [`Recording::crash_state`] then copies the state at the current point and takes
//! away what a power loss there may take ([`Model::pending`]), in one of the
//! [`Variant`]s a real disk allows: every pending op undone, then the chosen ones
//! done again in their order. What it models and what it does not is in
//! `docs/powerloss.md`.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions};
use std::hash::{Hash, Hasher};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use crate::journal;
use crate::model::{Model, Op, Uid};

/// What went wrong making a state.
#[derive(Debug)]
pub struct Error(pub String);

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

fn ctx<T>(r: std::io::Result<T>, what: impl FnOnce() -> String) -> Result<T> {
    r.map_err(|e| Error(format!("{}: {e}", what())))
}

/// The page a torn write is kept or lost by.
pub const PAGE: u64 = 4096;

/// What a power loss keeps of the data written since each file's last sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Data {
    /// Nothing.
    Lost,
    /// Per file, its first pending changes (how many: chosen at random).
    Prefix,
    /// Per 4 KiB page of each file, the first of the pending writes to it (how many:
    /// at random), and per file the first of its pending size changes: pages of one
    /// write kept or lost apart, as a disk writes a dirty page cache back.
    Pages,
}

/// What a power loss keeps of the entries created, removed or renamed in each
/// directory since its last sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Names {
    Lost,
    /// Per directory, its first pending changes in their order (how many: at random).
    Prefix,
}

/// One kind of power loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    pub data: Data,
    pub names: Names,
}

impl Variant {
    /// Every variant.
    pub const ALL: [Variant; 6] = [
        Variant {
            data: Data::Lost,
            names: Names::Lost,
        },
        Variant {
            data: Data::Prefix,
            names: Names::Lost,
        },
        Variant {
            data: Data::Pages,
            names: Names::Lost,
        },
        Variant {
            data: Data::Lost,
            names: Names::Prefix,
        },
        Variant {
            data: Data::Prefix,
            names: Names::Prefix,
        },
        Variant {
            data: Data::Pages,
            names: Names::Prefix,
        },
    ];

    /// The variant [`Variant`]'s `Display` names.
    pub fn parse(s: &str) -> Option<Variant> {
        Variant::ALL.into_iter().find(|v| v.to_string() == s)
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let data = match self.data {
            Data::Lost => "data-lost",
            Data::Prefix => "data-prefix",
            Data::Pages => "data-pages",
        };
        let names = match self.names {
            Names::Lost => "names-lost",
            Names::Prefix => "names-prefix",
        };
        write!(f, "{data}+{names}")
    }
}

/// Where a file or directory is in a work directory.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Loc {
    /// Named `name` in the directory `dir`.
    Tree(Uid, Vec<u8>),
    /// Without a name: `limbo/<uid>`.
    Limbo,
}

/// A copy of the recorded root (`tree/`) and of the inodes without a name there
/// (`limbo/`), and where each identity is in it.
#[derive(Debug, Clone)]
struct Work {
    dir: PathBuf,
    root: Uid,
    loc: HashMap<Uid, Loc>,
}

impl Work {
    fn path(&self, uid: Uid) -> Result<PathBuf> {
        if uid == self.root {
            return Ok(self.dir.join("tree"));
        }
        match self.loc.get(&uid) {
            Some(Loc::Tree(dir, name)) => Ok(self.path(*dir)?.join(OsStr::from_bytes(name))),
            Some(Loc::Limbo) => Ok(self.dir.join("limbo").join(uid.to_string())),
            None => Err(Error(format!(
                "#{uid} is nowhere in {:?}: the journal and the disk disagree",
                self.dir
            ))),
        }
    }

    fn relocate(&mut self, uid: Uid, to: Loc) -> Result<()> {
        let from = self.path(uid)?;
        let old = self.loc.insert(uid, to);
        let dest = self.path(uid)?;
        if dest.symlink_metadata().is_ok() {
            return Err(Error(format!(
                "moving #{uid} from {from:?} ({old:?}): {dest:?} is taken"
            )));
        }
        ctx(fs::rename(&from, &dest), || {
            format!("rename {from:?} to {dest:?}")
        })
    }

    fn file(&self, uid: Uid) -> Result<File> {
        let p = self.path(uid)?;
        ctx(OpenOptions::new().read(true).write(true).open(&p), || {
            format!("open {p:?}")
        })
    }

    fn write_at(&self, uid: Uid, off: u64, bytes: &[u8]) -> Result<()> {
        ctx(self.file(uid)?.write_all_at(bytes, off), || {
            format!("write #{uid} at {off}")
        })
    }

    fn set_len(&self, uid: Uid, len: u64) -> Result<()> {
        ctx(self.file(uid)?.set_len(len), || format!("resize #{uid}"))
    }

    /// Undo `op` (the work directory is as right after it); with `capture`, return
    /// the bytes a write wrote, to do it again later.
    fn undo(&mut self, op: &Op, capture: bool) -> Result<Option<Vec<u8>>> {
        match op {
            Op::Write {
                file,
                off,
                len,
                old_size,
                old,
            } => {
                let wrote = if capture {
                    let mut buf = vec![0; usize::try_from(*len).unwrap_or(0)];
                    ctx(self.file(*file)?.read_exact_at(&mut buf, *off), || {
                        format!("read back #{file} at {off}")
                    })?;
                    Some(buf)
                } else {
                    None
                };
                self.write_at(*file, *off, &old.to_vec())?;
                if off + len > *old_size {
                    self.set_len(*file, *old_size)?;
                }
                Ok(wrote)
            }
            Op::SetLen {
                file,
                old_size,
                new_size,
                tail,
            } => {
                self.set_len(*file, *old_size)?;
                if new_size < old_size {
                    self.write_at(*file, *new_size, &tail.to_vec())?;
                }
                Ok(None)
            }
            Op::Create { node, .. } | Op::Mkdir { node, .. } => {
                self.relocate(*node, Loc::Limbo).map(|()| None)
            }
            Op::Unlink { dir, name, node } | Op::Rmdir { dir, name, node } => self
                .relocate(*node, Loc::Tree(*dir, name.clone()))
                .map(|()| None),
            Op::Rename {
                dir,
                from,
                to,
                node,
                replaced,
            } => {
                self.relocate(*node, Loc::Tree(*dir, from.clone()))?;
                if let Some(r) = replaced {
                    self.relocate(*r, Loc::Tree(*dir, to.clone()))?;
                }
                Ok(None)
            }
            Op::Sync { .. } | Op::SyncEnd { .. } | Op::Cut | Op::Unmodeled(_) => Ok(None),
        }
    }

    /// Do `op` again after [`Work::undo`] (`wrote`: what it captured).
    fn redo(&mut self, op: &Op, wrote: Option<&[u8]>) -> Result<()> {
        match op {
            Op::Write { file, off, .. } => self.write_at(*file, *off, wrote.unwrap_or_default()),
            Op::SetLen { file, new_size, .. } => self.set_len(*file, *new_size),
            Op::Create { dir, name, node } | Op::Mkdir { dir, name, node } => {
                self.relocate(*node, Loc::Tree(*dir, name.clone()))
            }
            Op::Unlink { node, .. } | Op::Rmdir { node, .. } => self.relocate(*node, Loc::Limbo),
            Op::Rename {
                dir,
                to,
                node,
                replaced,
                ..
            } => {
                if let Some(r) = replaced {
                    self.relocate(*r, Loc::Limbo)?;
                }
                self.relocate(*node, Loc::Tree(*dir, to.clone()))
            }
            Op::Sync { .. } | Op::SyncEnd { .. } | Op::Cut | Op::Unmodeled(_) => Ok(()),
        }
    }
}

/// Copy the directory `from` to `to` (which must not exist), files and directories.
pub fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    ctx(fs::create_dir(to), || format!("create {to:?}"))?;
    for entry in ctx(fs::read_dir(from), || format!("list {from:?}"))? {
        let entry = ctx(entry, || format!("list {from:?}"))?;
        let kind = ctx(entry.file_type(), || format!("stat {:?}", entry.path()))?;
        let dest = to.join(entry.file_name());
        if kind.is_dir() {
            copy_tree(&entry.path(), &dest)?;
        } else if kind.is_file() {
            ctx(fs::copy(entry.path(), &dest), || {
                format!("copy {:?}", entry.path())
            })?;
        } else {
            return Err(Error(format!(
                "{:?} is neither file nor directory",
                entry.path()
            )));
        }
    }
    Ok(())
}

/// Every file and directory under `dir` by relative path: `dir`, or a file's length
/// and a hash of its bytes. Two equal digests are two equal trees.
pub fn digest(dir: &Path) -> Result<BTreeMap<String, String>> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, String>) -> Result<()> {
        for entry in ctx(fs::read_dir(dir), || format!("list {dir:?}"))? {
            let entry = ctx(entry, || format!("list {dir:?}"))?;
            let path = entry.path();
            let rel = path
                .strip_prefix(base)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            if ctx(entry.file_type(), || format!("stat {path:?}"))?.is_dir() {
                out.insert(rel, "dir".into());
                walk(base, &path, out)?;
            } else {
                let bytes = ctx(fs::read(&path), || format!("read {path:?}"))?;
                let mut h = std::collections::hash_map::DefaultHasher::new();
                bytes.hash(&mut h);
                out.insert(
                    rel,
                    format!("{} bytes, hash {:016x}", bytes.len(), h.finish()),
                );
            }
        }
        Ok(())
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out)?;
    Ok(out)
}

/// A recording opened on disk, at a point ([`Recording::at`]) it can go back from.
pub struct Recording {
    pub model: Model,
    master: Work,
    at: usize,
}

/// What [`Recording::crash_state`] took away and kept.
#[derive(Debug, Clone, Default)]
pub struct Loss {
    /// Pending ops (a power loss there may take each away) and how many were kept.
    pub pending: usize,
    pub kept: usize,
    /// Each pending op, described with the paths at the point.
    pub described: Vec<String>,
}

impl Recording {
    /// Read the journal at `journal`, and copy `root` (as the recorded process left
    /// it) and the recorder's `stash` into `work` (which must not exist), at the end
    /// of the recording. Fails on anything the journal cannot describe.
    pub fn open(journal_path: &Path, root: &Path, stash: &Path, work: &Path) -> Result<Recording> {
        let data = ctx(fs::read(journal_path), || format!("read {journal_path:?}"))?;
        let decoded = journal::decode(&data).map_err(|e| Error(e.to_string()))?;
        let mut model = Model::build(&decoded.records, decoded.torn_tail);
        ctx(fs::create_dir_all(work.join("limbo")), || {
            format!("create {work:?}")
        })?;
        let root_ino = ctx(fs::symlink_metadata(root), || format!("stat {root:?}"))?.ino();
        let root_uid = model.uid(root_ino);
        let mut master = Work {
            dir: work.to_path_buf(),
            root: root_uid,
            loc: HashMap::new(),
        };
        copy_tree(root, &work.join("tree"))?;
        locate_tree(&mut model, &mut master, root, root_uid)?;
        locate_stash(&mut model, &mut master, stash)?;
        locate_gone_dirs(&model, &mut master)?;
        let unmodeled = model.unmodeled();
        if !unmodeled.is_empty() {
            return Err(Error(format!(
                "the recording holds changes the model cannot undo: {unmodeled:?}"
            )));
        }
        let at = model.ops.len();
        Ok(Recording { model, master, at })
    }

    /// The point the work directory is at: after `ops[..at]`.
    pub fn at(&self) -> usize {
        self.at
    }

    /// The root as it is at the current point.
    pub fn tree(&self) -> PathBuf {
        self.master.dir.join("tree")
    }

    /// Take the work directory back to point `p` (at or before [`Recording::at`]).
    pub fn rewind(&mut self, p: usize) -> Result<()> {
        if p > self.at {
            return Err(Error(format!(
                "cannot go forward from {} to {p}: points are visited in decreasing order",
                self.at
            )));
        }
        for i in (p..self.at).rev() {
            let op = &self.model.ops[i].1;
            self.master
                .undo(op, false)
                .map_err(|e| Error(format!("undo op {i} ({op:?}): {}", e.0)))?;
            self.at = i;
        }
        Ok(())
    }

    /// The path of `uid` relative to the root at the current point, for messages.
    pub fn name_of(&self, uid: Uid) -> String {
        match self.master.path(uid) {
            Ok(p) => match p.strip_prefix(self.tree()) {
                Ok(rel) => rel.to_string_lossy().into_owned(),
                Err(_) => format!("(unnamed #{uid})"),
            },
            Err(_) => format!("(#{uid})"),
        }
    }

    /// Op `i`, described with the paths at the current point.
    pub fn describe(&self, i: usize) -> String {
        let name = |dir: Uid, n: &[u8]| {
            let d = self.name_of(dir);
            let n = String::from_utf8_lossy(n);
            if d.is_empty() {
                n.into_owned()
            } else {
                format!("{d}/{n}")
            }
        };
        match &self.model.ops[i].1 {
            Op::Write { file, off, len, .. } => {
                format!("write {} [{off}, +{len})", self.name_of(*file))
            }
            Op::SetLen {
                file,
                old_size,
                new_size,
                ..
            } => format!("resize {} {old_size} -> {new_size}", self.name_of(*file)),
            Op::Create { dir, name: n, .. } => format!("create {}", name(*dir, n)),
            Op::Mkdir { dir, name: n, .. } => format!("mkdir {}", name(*dir, n)),
            Op::Unlink { dir, name: n, .. } => format!("unlink {}", name(*dir, n)),
            Op::Rmdir { dir, name: n, .. } => format!("rmdir {}", name(*dir, n)),
            Op::Rename { dir, from, to, .. } => {
                format!("rename {} -> {}", name(*dir, from), name(*dir, to))
            }
            Op::Sync {
                data_only, path, ..
            } => format!(
                "{} {}",
                if *data_only { "fdatasync" } else { "fsync" },
                String::from_utf8_lossy(path)
            ),
            Op::SyncEnd { id, ok } => format!("sync {id} returned (ok: {ok})"),
            Op::Cut => "cut".into(),
            Op::Unmodeled(w) => format!("unmodeled: {w}"),
        }
    }

    /// Make in `out` (which must not exist) the disk a power loss at the current
    /// point leaves in `variant`, a sync for which `lie` holds counted as never done;
    /// `below(n)` picks a number in `0..n` for every random choice. The root is
    /// `out/tree`.
    pub fn crash_state(
        &self,
        variant: Variant,
        lie: &dyn Fn(&Model, usize) -> bool,
        below: &mut dyn FnMut(u64) -> u64,
        out: &Path,
    ) -> Result<Loss> {
        copy_tree(&self.master.dir, out)?;
        let mut work = Work {
            dir: out.to_path_buf(),
            ..self.master.clone()
        };
        let pending = self.model.pending(self.at, lie);
        let mut wrote: HashMap<usize, Vec<u8>> = HashMap::new();
        for &i in pending.iter().rev() {
            if let Some(w) = work.undo(&self.model.ops[i].1, true)? {
                wrote.insert(i, w);
            }
        }
        let keep = choose(&self.model, &pending, variant, below);
        let mut kept = 0;
        for &i in &pending {
            let op = &self.model.ops[i].1;
            match keep.get(&i) {
                Some(Kept::Whole) => work.redo(op, wrote.get(&i).map(Vec::as_slice))?,
                Some(Kept::Pages(ranges)) => {
                    let (Op::Write { file, off, .. }, Some(bytes)) = (op, wrote.get(&i)) else {
                        continue;
                    };
                    for &(lo, hi) in ranges {
                        let slice = &bytes[usize::try_from(lo - off).unwrap_or(0)
                            ..usize::try_from(hi - off).unwrap_or(0)];
                        work.write_at(*file, lo, slice)?;
                    }
                }
                None => continue,
            }
            kept += 1;
        }
        ctx(fs::remove_dir_all(out.join("limbo")), || {
            format!("remove {out:?}/limbo")
        })?;
        Ok(Loss {
            pending: pending.len(),
            kept,
            described: pending.iter().map(|&i| self.describe(i)).collect(),
        })
    }
}

/// What is kept of a pending op.
enum Kept {
    Whole,
    /// The byte ranges `[lo, hi)` of a write that are kept.
    Pages(Vec<(u64, u64)>),
}

/// Pending ops (with the byte range of a write's page) kept or lost as one sequence.
type Seq = Vec<(usize, Option<(u64, u64)>)>;

/// Which pending ops (or pages of them) `variant` keeps.
fn choose(
    model: &Model,
    pending: &[usize],
    variant: Variant,
    below: &mut dyn FnMut(u64) -> u64,
) -> HashMap<usize, Kept> {
    // Sequences of pending ops, each kept up to a random length: per directory, and
    // per file (Prefix) or per page of a file and per file's sizes (Pages).
    let mut seqs: BTreeMap<(Uid, u64), Seq> = BTreeMap::new();
    for &i in pending {
        let op = &model.ops[i].1;
        if let Some(dir) = op.dir_of() {
            if variant.names == Names::Prefix {
                seqs.entry((dir, u64::MAX)).or_default().push((i, None));
            }
            continue;
        }
        let Some(file) = op.data_of() else { continue };
        match (variant.data, op) {
            (Data::Lost, _) => {}
            (Data::Prefix, _) | (Data::Pages, Op::SetLen { .. }) => {
                seqs.entry((file, u64::MAX)).or_default().push((i, None));
            }
            (Data::Pages, Op::Write { off, len, .. }) => {
                let mut lo = *off;
                while lo < off + len {
                    let page = lo / PAGE;
                    let hi = ((page + 1) * PAGE).min(off + len);
                    seqs.entry((file, page))
                        .or_default()
                        .push((i, Some((lo, hi))));
                    lo = hi;
                }
            }
            (Data::Pages, _) => {}
        }
    }
    let mut keep: HashMap<usize, Kept> = HashMap::new();
    for seq in seqs.values() {
        let n = below(seq.len() as u64 + 1);
        for &(i, range) in seq.iter().take(usize::try_from(n).unwrap_or(0)) {
            match range {
                None => {
                    keep.insert(i, Kept::Whole);
                }
                Some(r) => {
                    if let Kept::Pages(ranges) =
                        keep.entry(i).or_insert_with(|| Kept::Pages(Vec::new()))
                    {
                        ranges.push(r);
                    }
                }
            }
        }
    }
    keep
}

/// Give every file and directory of the copied tree its identity and place.
fn locate_tree(model: &mut Model, work: &mut Work, dir: &Path, dir_uid: Uid) -> Result<()> {
    model.dirs.insert(dir_uid);
    for entry in ctx(fs::read_dir(dir), || format!("list {dir:?}"))? {
        let entry = ctx(entry, || format!("list {dir:?}"))?;
        let meta = ctx(entry.metadata(), || format!("stat {:?}", entry.path()))?;
        let uid = model.uid(meta.ino());
        let here = Loc::Tree(dir_uid, entry.file_name().as_bytes().to_vec());
        if let Some(other) = work.loc.insert(uid, here) {
            return Err(Error(format!(
                "{:?} is a second name of an inode also at {other:?}: hard links are not modeled",
                entry.path()
            )));
        }
        if meta.is_dir() {
            locate_tree(model, work, &entry.path(), uid)?;
        } else {
            model.final_size(uid, meta.len());
        }
    }
    Ok(())
}

/// Move the stashed inodes (names removed during the recording) into `limbo/`.
fn locate_stash(model: &mut Model, work: &mut Work, stash: &Path) -> Result<()> {
    let entries = match fs::read_dir(stash) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error(format!("list {stash:?}: {e}"))),
    };
    for entry in entries {
        let entry = ctx(entry, || format!("list {stash:?}"))?;
        let n: Option<u64> = entry.file_name().to_str().and_then(|s| s.parse().ok());
        // A link whose removal never happened (the op failed) is not in the journal.
        let Some(&uid) = n.and_then(|n| model.stashed.get(&n)) else {
            continue;
        };
        if work.loc.contains_key(&uid) {
            // Still named in the tree (a later op gave it a name again): not modeled.
            return Err(Error(format!(
                "stashed {:?} is also in the tree",
                entry.path()
            )));
        }
        work.loc.insert(uid, Loc::Limbo);
        let dest = work.path(uid)?;
        ctx(fs::copy(entry.path(), &dest), || {
            format!("copy {:?}", entry.path())
        })?;
        let len = ctx(fs::metadata(&dest), || format!("stat {dest:?}"))?.len();
        model.final_size(uid, len);
    }
    Ok(())
}

/// An empty directory in `limbo/` for each directory the recording removed.
fn locate_gone_dirs(model: &Model, work: &mut Work) -> Result<()> {
    for (_, op) in &model.ops {
        if let Op::Rmdir { node, .. } | Op::Mkdir { node, .. } = op {
            if !work.loc.contains_key(node) {
                work.loc.insert(*node, Loc::Limbo);
                let p = work.path(*node)?;
                ctx(fs::create_dir(&p), || format!("create {p:?}"))?;
            }
        }
    }
    Ok(())
}

/// Seeded random choices for [`Recording::crash_state`]: a state and its seed make
/// the same disk again (`turnd-powerloss state`). xorshift64* (Vigna 2016), written
/// out so that a seed keeps its meaning.
#[derive(Debug, Clone)]
pub struct Dice(u64);

impl Dice {
    pub fn new(seed: u64) -> Dice {
        // Spread the seed over the state (never zero, which would stay zero), and
        // leave behind the first outputs, which follow a simple seed closely.
        let mut d = Dice(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        for _ in 0..8 {
            d.next();
        }
        d
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n` (0 when `n` is 0), from the high bits of the output.
    pub fn below(&mut self, n: u64) -> u64 {
        let r = self.next();
        u64::try_from((u128::from(r) * u128::from(n)) >> 64).unwrap_or(0)
    }
}
