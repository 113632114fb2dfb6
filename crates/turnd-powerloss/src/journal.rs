//! The journal the recorder of `turnd-faultfs` writes: every change to the files and
//! directories under one root, in the order the process made them, each with what it
//! takes to undo it, and every `fsync`/`fdatasync` of a file or directory there.
//!
//! The recorder writes an entry with one `write` to a file opened `O_APPEND`, while it
//! holds the lock every recorded change takes, so the journal's order is the order in
//! which the changes reached the kernel, and an entry is in the page cache (which a
//! SIGKILL of the process does not lose) before the call it records returns. A change
//! is written to the journal after it was made (its undo data read before), so an
//! entry always describes a change that happened; a sync gets an entry before it
//! starts and one after it returned.
//!
//! **Frame.** `len: u32 LE | tag: u8 | t_ns: u64 LE | fields`, `len` counting what
//! follows it. `t_ns` is `CLOCK_MONOTONIC` ([`now_ns`]) when the entry was written, so
//! a test can order an acknowledgement it received against the entries. Integers are
//! little-endian `u64`, byte strings a `u64` length and the bytes. A file starts with
//! [`MAGIC`]. A frame cut short at the end (the process died while writing it) is
//! dropped by [`decode`], which says so.
//!
//! Inodes name files: a path changes with renames and a file may be written after its
//! last name is gone. The recorder keeps every inode it removes a name of alive with a
//! hard link in its stash directory, so no inode number is reused for another file
//! during a recording (a removed directory's may be: [`crate::model`] gives every
//! created inode an identity of its own).

/// The first bytes of a journal file.
pub const MAGIC: &[u8; 8] = b"TPLJ0001";

/// Bytes a frame's header takes before its fields: length, tag, time.
const HEAD: usize = 4 + 1 + 8;

/// The bytes a change overwrote or cut off: kept as they were, or known to be zeros
/// (a preallocated segment, a hole), which the journal stores as a length only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Old {
    Zeros(u64),
    Bytes(Vec<u8>),
}

impl Old {
    /// `bytes` as an [`Old`]: zeros stored as a length.
    pub fn of(bytes: Vec<u8>) -> Old {
        if bytes.iter().all(|b| *b == 0) {
            Old::Zeros(bytes.len() as u64)
        } else {
            Old::Bytes(bytes)
        }
    }

    /// The bytes themselves.
    pub fn to_vec(&self) -> Vec<u8> {
        match self {
            Old::Zeros(n) => vec![0; usize::try_from(*n).unwrap_or(0)],
            Old::Bytes(b) => b.clone(),
        }
    }

    pub fn len(&self) -> u64 {
        match self {
            Old::Zeros(n) => *n,
            Old::Bytes(b) => b.len() as u64,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One recorded change or sync. `parent`, `ino`, … are inode numbers; `name`s are
/// single path components; `path`s are relative to the recorded root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// `len` bytes written at `off` of a file `old_size` long before; `old` is what the
    /// write replaced inside the old size (`min(off + len, old_size) - off` bytes).
    Write {
        ino: u64,
        off: u64,
        len: u64,
        old_size: u64,
        old: Old,
    },
    /// A file's size changed from `old_size` to `new_size` (`ftruncate`, `fallocate`,
    /// an `O_TRUNC` open); `tail` holds the bytes a shrink cut off.
    SetLen {
        ino: u64,
        old_size: u64,
        new_size: u64,
        tail: Old,
    },
    /// An `fsync` (`data_only`: `fdatasync`) of a file or directory (`dir`) began;
    /// `size` is the file's size then, so that a size change made without a recorded
    /// call shows.
    SyncBegin {
        ino: u64,
        id: u64,
        data_only: bool,
        dir: bool,
        size: u64,
        path: Vec<u8>,
    },
    /// The sync `id` returned, successfully or not.
    SyncEnd { id: u64, ok: bool },
    /// A file was created (an `open` with `O_CREAT` of a name that did not exist).
    Create {
        parent: u64,
        name: Vec<u8>,
        ino: u64,
    },
    /// A directory was created.
    Mkdir {
        parent: u64,
        name: Vec<u8>,
        ino: u64,
    },
    /// A file's name was removed; the inode is kept as `stash/<stash>`.
    Unlink {
        parent: u64,
        name: Vec<u8>,
        ino: u64,
        stash: u64,
    },
    /// An empty directory was removed.
    Rmdir {
        parent: u64,
        name: Vec<u8>,
        ino: u64,
    },
    /// `from` was renamed `to` in the same directory; a file `to` named before is kept
    /// as `stash/<stash>` (`replaced`: its inode and stash number).
    Rename {
        parent: u64,
        from: Vec<u8>,
        to: Vec<u8>,
        ino: u64,
        replaced: Option<(u64, u64)>,
    },
    /// A change under the root that the journal cannot describe (a writable shared
    /// mapping, a rename across directories, a hard link, …): a test must fail on it.
    Unmodeled { what: String },
    /// The recorder killed the process here (its cut).
    Cut,
}

/// An entry with the time it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub t_ns: u64,
    pub entry: Entry,
}

/// `CLOCK_MONOTONIC` in nanoseconds: the clock of [`Record::t_ns`].
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

struct Enc(Vec<u8>);

impl Enc {
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
    }
    fn old(&mut self, o: &Old) {
        match o {
            Old::Zeros(n) => {
                self.0.push(0);
                self.u64(*n);
            }
            Old::Bytes(b) => {
                self.0.push(1);
                self.bytes(b);
            }
        }
    }
}

/// The frame of `entry` written at `t_ns`.
pub fn encode(t_ns: u64, entry: &Entry) -> Vec<u8> {
    let mut e = Enc(Vec::with_capacity(64));
    e.0.extend_from_slice(&[0; 4]);
    e.0.push(tag(entry));
    e.u64(t_ns);
    e.fields(entry);
    let len = u32::try_from(e.0.len() - 4).unwrap_or(u32::MAX);
    e.0[..4].copy_from_slice(&len.to_le_bytes());
    e.0
}

impl Enc {
    fn fields(&mut self, entry: &Entry) {
        let e = self;
        match entry {
            Entry::Write {
                ino,
                off,
                len,
                old_size,
                old,
            } => {
                for v in [*ino, *off, *len, *old_size] {
                    e.u64(v);
                }
                e.old(old);
            }
            Entry::SetLen {
                ino,
                old_size,
                new_size,
                tail,
            } => {
                for v in [*ino, *old_size, *new_size] {
                    e.u64(v);
                }
                e.old(tail);
            }
            Entry::SyncBegin {
                ino,
                id,
                data_only,
                dir,
                size,
                path,
            } => {
                let flags = u64::from(*data_only) | u64::from(*dir) << 1;
                for v in [*ino, *id, flags, *size] {
                    e.u64(v);
                }
                e.bytes(path);
            }
            Entry::SyncEnd { id, ok } => {
                e.u64(*id);
                e.u64(u64::from(*ok));
            }
            Entry::Create { parent, name, ino }
            | Entry::Mkdir { parent, name, ino }
            | Entry::Rmdir { parent, name, ino } => {
                e.u64(*parent);
                e.bytes(name);
                e.u64(*ino);
            }
            Entry::Unlink {
                parent,
                name,
                ino,
                stash,
            } => {
                e.u64(*parent);
                e.bytes(name);
                e.u64(*ino);
                e.u64(*stash);
            }
            Entry::Rename {
                parent,
                from,
                to,
                ino,
                replaced,
            } => {
                e.u64(*parent);
                e.bytes(from);
                e.bytes(to);
                e.u64(*ino);
                let (r_ino, r_stash) = replaced.unwrap_or((0, u64::MAX));
                e.u64(u64::from(replaced.is_some()));
                e.u64(r_ino);
                e.u64(r_stash);
            }
            Entry::Unmodeled { what } => e.bytes(what.as_bytes()),
            Entry::Cut => {}
        }
    }
}

fn tag(entry: &Entry) -> u8 {
    match entry {
        Entry::Write { .. } => 1,
        Entry::SetLen { .. } => 2,
        Entry::SyncBegin { .. } => 3,
        Entry::SyncEnd { .. } => 4,
        Entry::Create { .. } => 5,
        Entry::Mkdir { .. } => 6,
        Entry::Unlink { .. } => 7,
        Entry::Rmdir { .. } => 8,
        Entry::Rename { .. } => 9,
        Entry::Unmodeled { .. } => 10,
        Entry::Cut => 11,
    }
}

/// A journal read back.
#[derive(Debug, Default)]
pub struct Decoded {
    pub records: Vec<Record>,
    /// The last frame was cut short (and dropped).
    pub torn_tail: bool,
}

/// Why a journal could not be read.
#[derive(Debug)]
pub struct BadJournal(pub String);

impl std::fmt::Display for BadJournal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "bad power-loss journal: {}", self.0)
    }
}

impl std::error::Error for BadJournal {}

struct Dec<'a> {
    b: &'a [u8],
}

impl Dec<'_> {
    fn u64(&mut self) -> Result<u64, BadJournal> {
        let (head, rest) = self
            .b
            .split_first_chunk::<8>()
            .ok_or_else(|| BadJournal("a field runs past its frame".into()))?;
        self.b = rest;
        Ok(u64::from_le_bytes(*head))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, BadJournal> {
        let n = usize::try_from(self.u64()?).map_err(|_| BadJournal("huge length".into()))?;
        if n > self.b.len() {
            return Err(BadJournal("a byte string runs past its frame".into()));
        }
        let (v, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(v.to_vec())
    }
    fn old(&mut self) -> Result<Old, BadJournal> {
        let (kind, rest) = self
            .b
            .split_first()
            .ok_or_else(|| BadJournal("missing old bytes".into()))?;
        self.b = rest;
        match kind {
            0 => Ok(Old::Zeros(self.u64()?)),
            1 => Ok(Old::Bytes(self.bytes()?)),
            k => Err(BadJournal(format!("unknown kind {k} of old bytes"))),
        }
    }
    fn name_entry(&mut self) -> Result<(u64, Vec<u8>, u64), BadJournal> {
        Ok((self.u64()?, self.bytes()?, self.u64()?))
    }
}

/// Every whole frame of `data` (a journal file's contents).
pub fn decode(data: &[u8]) -> Result<Decoded, BadJournal> {
    let Some(mut rest) = data.strip_prefix(MAGIC.as_slice()) else {
        return Err(BadJournal("no magic at the start".into()));
    };
    let mut out = Decoded::default();
    while !rest.is_empty() {
        let Some((len, body)) = rest.split_first_chunk::<4>() else {
            out.torn_tail = true;
            break;
        };
        let len = u32::from_le_bytes(*len) as usize;
        if len + 4 < HEAD || body.len() < len {
            out.torn_tail = true;
            break;
        }
        let (frame, next) = body.split_at(len);
        rest = next;
        out.records.push(decode_frame(frame)?);
    }
    Ok(out)
}

fn decode_frame(frame: &[u8]) -> Result<Record, BadJournal> {
    let (&tag, fields) = frame
        .split_first()
        .ok_or_else(|| BadJournal("empty frame".into()))?;
    let mut d = Dec { b: fields };
    let t_ns = d.u64()?;
    let entry = match tag {
        1 => Entry::Write {
            ino: d.u64()?,
            off: d.u64()?,
            len: d.u64()?,
            old_size: d.u64()?,
            old: d.old()?,
        },
        2 => Entry::SetLen {
            ino: d.u64()?,
            old_size: d.u64()?,
            new_size: d.u64()?,
            tail: d.old()?,
        },
        3 => {
            let (ino, id, flags) = (d.u64()?, d.u64()?, d.u64()?);
            Entry::SyncBegin {
                ino,
                id,
                data_only: flags & 1 != 0,
                dir: flags & 2 != 0,
                size: d.u64()?,
                path: d.bytes()?,
            }
        }
        4 => Entry::SyncEnd {
            id: d.u64()?,
            ok: d.u64()? != 0,
        },
        5 | 6 | 8 => {
            let (parent, name, ino) = d.name_entry()?;
            match tag {
                5 => Entry::Create { parent, name, ino },
                6 => Entry::Mkdir { parent, name, ino },
                _ => Entry::Rmdir { parent, name, ino },
            }
        }
        7 => {
            let (parent, name, ino) = d.name_entry()?;
            Entry::Unlink {
                parent,
                name,
                ino,
                stash: d.u64()?,
            }
        }
        9 => {
            let (parent, from, to, ino) = (d.u64()?, d.bytes()?, d.bytes()?, d.u64()?);
            let (has, r_ino, r_stash) = (d.u64()?, d.u64()?, d.u64()?);
            Entry::Rename {
                parent,
                from,
                to,
                ino,
                replaced: (has != 0).then_some((r_ino, r_stash)),
            }
        }
        10 => Entry::Unmodeled {
            what: String::from_utf8_lossy(&d.bytes()?).into_owned(),
        },
        11 => Entry::Cut,
        t => return Err(BadJournal(format!("unknown tag {t}"))),
    };
    Ok(Record { t_ns, entry })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_kind() -> Vec<Entry> {
        vec![
            Entry::Write {
                ino: 7,
                off: 4096,
                len: 10,
                old_size: 4100,
                old: Old::Bytes(vec![1, 2, 3, 4]),
            },
            Entry::SetLen {
                ino: 7,
                old_size: 10,
                new_size: 0,
                tail: Old::Zeros(10),
            },
            Entry::SyncBegin {
                ino: 7,
                id: 3,
                data_only: true,
                dir: false,
                size: 99,
                path: b"log/a.seg".to_vec(),
            },
            Entry::SyncEnd { id: 3, ok: false },
            Entry::Create {
                parent: 1,
                name: b"a".to_vec(),
                ino: 2,
            },
            Entry::Mkdir {
                parent: 1,
                name: b"d".to_vec(),
                ino: 3,
            },
            Entry::Unlink {
                parent: 1,
                name: b"a".to_vec(),
                ino: 2,
                stash: 5,
            },
            Entry::Rmdir {
                parent: 1,
                name: b"d".to_vec(),
                ino: 3,
            },
            Entry::Rename {
                parent: 1,
                from: b"x".to_vec(),
                to: b"y".to_vec(),
                ino: 4,
                replaced: Some((9, 6)),
            },
            Entry::Rename {
                parent: 1,
                from: b"x".to_vec(),
                to: b"y".to_vec(),
                ino: 4,
                replaced: None,
            },
            Entry::Unmodeled {
                what: "mmap".into(),
            },
            Entry::Cut,
        ]
    }

    #[test]
    fn every_entry_reads_back_as_written() {
        let mut data = MAGIC.to_vec();
        for (i, e) in every_kind().iter().enumerate() {
            data.extend(encode(i as u64 + 100, e));
        }
        let d = decode(&data).expect("decode");
        assert!(!d.torn_tail);
        let back: Vec<Entry> = d.records.iter().map(|r| r.entry.clone()).collect();
        assert_eq!(back, every_kind());
        assert_eq!(d.records[3].t_ns, 103);
    }

    #[test]
    fn a_frame_cut_short_is_dropped_and_reported() {
        let mut data = MAGIC.to_vec();
        data.extend(encode(1, &Entry::Cut));
        let whole = data.len();
        data.extend(encode(2, &every_kind()[0]));
        for cut in whole + 1..data.len() {
            let d = decode(&data[..cut]).expect("decode");
            assert_eq!(d.records.len(), 1, "cut at {cut}");
            assert!(d.torn_tail, "cut at {cut}");
        }
        assert!(decode(b"nonsense").is_err());
    }

    #[test]
    fn zeros_are_stored_as_a_length() {
        assert_eq!(Old::of(vec![0; 5]), Old::Zeros(5));
        assert_eq!(Old::of(vec![0, 1]), Old::Bytes(vec![0, 1]));
        assert_eq!(Old::Zeros(3).to_vec(), vec![0, 0, 0]);
    }
}
