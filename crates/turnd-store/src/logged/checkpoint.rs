//! A store's checkpoint: its sled database written out at an applied mark, and put
//! in place of another store's, so that a node whose store is behind what a commit
//! log still holds can start again from a peer's store and read the log only past
//! the mark.
//!
//! **Write** ([`LoggedKv::write_checkpoint`]). The applied mark `M` is read first,
//! then every key and value of sled, while the applier goes on. sled holds every
//! record up to `M` then (the applier records a mark only after everything up to it
//! is written), but for the live records the applier carried instead: their newest
//! value is in a record after `M` (`overlay::carries`). Each key only moves forward
//! after that: a key read later may
//! hold a newer value than at `M`, but only one written by a record after `M`.
//! Every record the log applies is a whole value or a delete of its key, so
//! applying the log's records after `M` on top (as a start or a standby does) ends
//! with exactly what a store that applied them all holds. The checkpoint's mark is
//! `M`, whatever `APPLIED_KEY` the scan read later.
//!
//! **Install** ([`install_checkpoint`]). The database is made beside the store's
//! directory, synced, and renamed in its place (the old one removed after), so a
//! crash leaves either the old store or the whole new one.
//!
//! The stream: `TDCKPT01`, the mark (u64, big-endian), then each entry as a key and a
//! value, each a u32 length (big-endian) and its bytes, then `u32::MAX`, the count of
//! entries (u64) and the CRC-32 of everything before it. A cut or damaged stream is
//! refused. Windows are not carried: a store in a cluster keeps none
//! (`window_ms = 0`), and a store with windows is refused.

use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use super::apply::APPLIED_KEY;
use super::{LoggedKv, LoggedOptions};
use crate::error::{IoOp, StoreError};
use crate::sled::{sync_dir, Shared, SledOptions};

const MAGIC: &[u8; 8] = b"TDCKPT01";
/// Entries written to sled in one batch when a checkpoint is installed.
const INSTALL_BATCH: usize = 1024;

/// What a checkpoint holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointInfo {
    /// The applied mark: a store from it reads the log from the record after.
    pub mark: u64,
    /// Keys and values.
    pub entries: u64,
}

/// A writer that keeps the CRC-32 of what went through it.
struct Summed<W> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Summed<W> {
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.crc.update(bytes);
        self.inner.write_all(bytes)
    }

    fn put_bytes(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        let len = u32::try_from(bytes.len())
            .ok()
            .filter(|l| *l != u32::MAX)
            .ok_or_else(|| std::io::Error::other("a key or value too large to checkpoint"))?;
        self.put(&len.to_be_bytes())?;
        self.put(bytes)
    }
}

fn io_err(what: &str, e: &std::io::Error) -> StoreError {
    StoreError::io(IoOp::Write, format_args!("{what}"), e)
}

impl LoggedKv {
    /// Write a checkpoint of this store to `out` (see the module documentation);
    /// what it holds. Applies go on meanwhile; a checkpoint of sled (its close and
    /// open) waits for it.
    pub fn write_checkpoint(&self, out: &mut dyn Write) -> Result<CheckpointInfo, StoreError> {
        if !self.inner.windows.all_open().is_empty() {
            return Err(StoreError::Write(
                "a store with time windows cannot be checkpointed".into(),
            ));
        }
        let mut w = Summed {
            inner: BufWriter::new(out),
            crc: crc32fast::Hasher::new(),
        };
        let err = |e: std::io::Error| io_err("write a checkpoint", &e);
        self.inner.sled.with(|h| {
            let mark = match h.db.get(APPLIED_KEY) {
                Ok(Some(v)) => u64::from_be_bytes(v.as_ref().try_into().map_err(|_| {
                    StoreError::Corrupt(format!("applied mark of {} bytes", v.len()))
                })?),
                Ok(None) => 0,
                Err(e) => return Err(StoreError::Read(e.to_string())),
            };
            w.put(MAGIC).map_err(err)?;
            w.put(&mark.to_be_bytes()).map_err(err)?;
            let mut entries = 0u64;
            for kv in h.db.iter() {
                let (k, v) = kv.map_err(|e| StoreError::Read(e.to_string()))?;
                if k.as_ref() == APPLIED_KEY {
                    continue;
                }
                w.put_bytes(&k).map_err(err)?;
                w.put_bytes(&v).map_err(err)?;
                entries += 1;
            }
            w.put(&u32::MAX.to_be_bytes()).map_err(err)?;
            w.put(&entries.to_be_bytes()).map_err(err)?;
            let crc = w.crc.clone().finalize();
            w.inner.write_all(&crc.to_be_bytes()).map_err(err)?;
            w.inner.flush().map_err(err)?;
            Ok(CheckpointInfo { mark, entries })
        })
    }
}

/// A reader that keeps the CRC-32 of what it read.
struct Checked<R> {
    inner: R,
    crc: crc32fast::Hasher,
}

impl<R: Read> Checked<R> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], StoreError> {
        let mut b = [0u8; N];
        self.inner.read_exact(&mut b).map_err(cut)?;
        self.crc.update(&b);
        Ok(b)
    }

    fn take_vec(&mut self, len: u32) -> Result<Vec<u8>, StoreError> {
        let mut v = Vec::new();
        (&mut self.inner)
            .take(u64::from(len))
            .read_to_end(&mut v)
            .map_err(cut)?;
        if v.len() != len as usize {
            return Err(cut(std::io::ErrorKind::UnexpectedEof.into()));
        }
        self.crc.update(&v);
        Ok(v)
    }
}

fn cut(e: std::io::Error) -> StoreError {
    StoreError::Corrupt(format!("the checkpoint is cut short or unreadable: {e}"))
}

/// The directory a checkpoint is made in beside `dir`, and where the old store goes.
fn beside(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    dir.with_file_name(name)
}

/// Put the checkpoint read from `input` in place of the store in `dir` (which may
/// hold another, or nothing); what it holds. The store in `dir` must not be open.
pub fn install_checkpoint(
    dir: &Path,
    input: &mut dyn Read,
    opts: LoggedOptions,
) -> Result<CheckpointInfo, StoreError> {
    let (making, old) = (beside(dir, ".ckpt"), beside(dir, ".old"));
    for d in [&making, &old] {
        if d.exists() {
            std::fs::remove_dir_all(d).map_err(|e| io_err(&format!("remove {d:?}"), &e))?;
        }
    }
    let info = fill(&making, input, opts.sled)?;
    if dir.exists() {
        std::fs::rename(dir, &old).map_err(|e| io_err(&format!("move {dir:?} aside"), &e))?;
    }
    std::fs::rename(&making, dir).map_err(|e| io_err(&format!("move {making:?}"), &e))?;
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| io_err(&format!("remove {old:?}"), &e))?;
    }
    Ok(info)
}

/// Make a sled database in `dir` holding the checkpoint read from `input`, synced.
fn fill(dir: &Path, input: &mut dyn Read, opts: SledOptions) -> Result<CheckpointInfo, StoreError> {
    let mut r = Checked {
        inner: BufReader::new(input),
        crc: crc32fast::Hasher::new(),
    };
    if &r.take::<8>()? != MAGIC {
        return Err(StoreError::Corrupt("not a turnd checkpoint".into()));
    }
    let mark = u64::from_be_bytes(r.take()?);
    let sled = Shared::open(dir, opts)?;
    let mut entries = 0u64;
    let mut batch = sled::Batch::default();
    let mut in_batch = 0;
    loop {
        let klen = u32::from_be_bytes(r.take()?);
        if klen == u32::MAX {
            break;
        }
        let k = r.take_vec(klen)?;
        let vlen = u32::from_be_bytes(r.take()?);
        let v = r.take_vec(vlen)?;
        batch.insert(k, v);
        entries += 1;
        in_batch += 1;
        if in_batch == INSTALL_BATCH {
            write(&sled, std::mem::take(&mut batch))?;
            in_batch = 0;
        }
    }
    let count = u64::from_be_bytes(r.take()?);
    let sum = r.crc.clone().finalize();
    let crc = {
        let mut b = [0u8; 4];
        r.inner.read_exact(&mut b).map_err(cut)?;
        u32::from_be_bytes(b)
    };
    if count != entries || crc != sum {
        return Err(StoreError::Corrupt(format!(
            "the checkpoint does not add up: {entries} entries read of {count}, CRC {sum:08x} of {crc:08x}"
        )));
    }
    batch.insert(APPLIED_KEY, &mark.to_be_bytes());
    write(&sled, batch)?;
    sled.with(|h| sled.sync_files(h))?;
    sled.close();
    Ok(CheckpointInfo { mark, entries })
}

fn write(sled: &Shared, batch: sled::Batch) -> Result<(), StoreError> {
    sled.with(|h| {
        h.db.apply_batch(batch)
            .map_err(|e| StoreError::Write(format!("install a checkpoint: {e}")))
    })
}
