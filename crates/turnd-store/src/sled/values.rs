//! A time window's value file: the large values of a window (finished turn records),
//! kept out of its sled database.
//!
//! sled 0.34 appends every update of a leaf as a fragment and rewrites the whole leaf
//! every few fragments, and its segment cleaning moves live leaves again: with
//! finished turn records of 1 – 6 KB in the leaves, the device took about 3.5 bytes
//! for each byte a window kept (`docs/benchmarks.md`). A window's large values are
//! instead appended once to `DATA_DIR/windows/<start>/values`, and sled holds a
//! pointer of [`POINTER_LEN`] bytes to each: the leaves sled rewrites stay small.
//!
//! The file needs no cleaning of its own: a window takes its finished turns once and
//! is deleted whole by retention. What a turn amended late leaves behind in it (its
//! older record) goes with the window.
//!
//! Durability follows the window's: the applier syncs the file with the window's
//! sled before it records an applied mark past their writes
//! ([`super::Shared::sync_files`]), and a start replays the commit log
//! from that mark, writing every value since then again (to the file's end, with new
//! pointers). So a pointer sled made durable on its own, to bytes the crash lost, is
//! always written over before it is read. Bytes past the last pointer (a torn tail,
//! a write that failed) are never read.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

use crate::error::{IoOp, StoreError};

/// The file's name in the window's directory.
pub(crate) const FILE_NAME: &str = "values";

/// A value kept in the file is stored in sled as these two bytes (no stored value
/// starts with them: JSON text, turn ids, LZ4-packed values start `0, '4'`), then
/// its offset (u64), its length (u32) and the CRC-32 of its bytes (u32), big-endian.
const POINTER: [u8; 2] = [0, b'V'];
/// Bytes of a pointer.
pub(crate) const POINTER_LEN: usize = 2 + 8 + 4 + 4;

/// Stored values at least this long go to the file: a finished turn record (about
/// 1.4 KB packed for a one-step turn of tiny payloads) does, a session's turn list
/// entry, an idempotency key or a small event does not.
pub(crate) const OUT_FROM: usize = 256;

/// Whether `v` (a value as sled holds it) is a pointer into a value file.
pub(crate) fn is_pointer(v: &[u8]) -> bool {
    v.len() == POINTER_LEN && v.starts_with(&POINTER)
}

/// The parts of a pointer: offset, length, CRC-32.
fn parse(v: &[u8]) -> Option<(u64, u32, u32)> {
    if !is_pointer(v) {
        return None;
    }
    let off = u64::from_be_bytes(v.get(2..10)?.try_into().ok()?);
    let len = u32::from_be_bytes(v.get(10..14)?.try_into().ok()?);
    let crc = u32::from_be_bytes(v.get(14..18)?.try_into().ok()?);
    Some((off, len, crc))
}

fn pointer(off: u64, bytes: &[u8]) -> [u8; POINTER_LEN] {
    let mut p = [0u8; POINTER_LEN];
    p[..2].copy_from_slice(&POINTER);
    p[2..10].copy_from_slice(&off.to_be_bytes());
    p[10..14].copy_from_slice(&(bytes.len() as u32).to_be_bytes());
    p[14..18].copy_from_slice(&crc32fast::hash(bytes).to_be_bytes());
    p
}

/// Have the kernel start writing `len` bytes at `off` of `file` to the disk now,
/// without waiting for them: a hint, so that the next `fdatasync` of the file
/// finds them written or on their way rather than submits them all at once.
fn start_write_back(file: &File, off: u64, len: usize) {
    use std::os::fd::AsRawFd;
    let (Ok(off), Ok(len)) = (i64::try_from(off), i64::try_from(len)) else {
        return;
    };
    // SAFETY: `file` is open for the whole call; the kernel only reads the
    // arguments, and the call touches no memory of this process.
    let r =
        unsafe { libc::sync_file_range(file.as_raw_fd(), off, len, libc::SYNC_FILE_RANGE_WRITE) };
    if r != 0 {
        // A write that failed is reported by the file's next `fdatasync`.
        tracing::debug!(
            "sync_file_range of a window's value file: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// A window's value file, open for appends and reads.
pub(crate) struct ValueFile {
    file: File,
    /// Where the next append goes: the file's length when opened, moved on by each
    /// append that was written whole. A failed append leaves it, and the next one
    /// writes over what the failed one left.
    end: Mutex<u64>,
}

impl ValueFile {
    /// Open (or create) the value file in `dir`. A new file's directory entry is
    /// synced before any pointer to it can be.
    pub(crate) fn open(dir: &Path) -> Result<ValueFile, StoreError> {
        let path = dir.join(FILE_NAME);
        let existed = path.exists();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| StoreError::io(IoOp::Write, format_args!("open {path:?}"), &e))?;
        if !existed {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| StoreError::io(IoOp::Sync, format_args!("fsync dir {dir:?}"), &e))?;
        }
        let end = file
            .metadata()
            .map_err(|e| StoreError::io(IoOp::Read, format_args!("stat {path:?}"), &e))?
            .len();
        Ok(ValueFile {
            file,
            end: Mutex::new(end),
        })
    }

    /// Append `values` in one write, and return the pointer to each, in order.
    pub(crate) fn append(&self, values: &[&[u8]]) -> Result<Vec<[u8; POINTER_LEN]>, StoreError> {
        let mut end = self
            .end
            .lock()
            .map_err(|_| StoreError::Write("value file lock poisoned".into()))?;
        let mut buf = Vec::with_capacity(values.iter().map(|v| v.len()).sum());
        let mut pointers = Vec::with_capacity(values.len());
        for v in values {
            pointers.push(pointer(*end + buf.len() as u64, v));
            buf.extend_from_slice(v);
        }
        self.file
            .write_all_at(&buf, *end)
            .map_err(|e| StoreError::io(IoOp::Write, "write to a window's value file", &e))?;
        start_write_back(&self.file, *end, buf.len());
        *end += buf.len() as u64;
        Ok(pointers)
    }

    /// The value a pointer names, checked against its CRC.
    pub(crate) fn read(&self, ptr: &[u8]) -> Result<Vec<u8>, StoreError> {
        let (off, len, crc) =
            parse(ptr).ok_or_else(|| StoreError::Corrupt("not a value file pointer".into()))?;
        let end = self.end.lock().map_or(u64::MAX, |e| *e);
        if off.saturating_add(u64::from(len)) > end {
            return Err(StoreError::Corrupt(format!(
                "a pointer to {len} bytes at {off} of a window's value file of {end} bytes"
            )));
        }
        let mut buf = vec![0u8; len as usize];
        self.file.read_exact_at(&mut buf, off).map_err(|e| {
            StoreError::Corrupt(format!(
                "a window's value file has no {len} bytes at {off}: {e}"
            ))
        })?;
        if crc32fast::hash(&buf) != crc {
            return Err(StoreError::Corrupt(format!(
                "the {len} bytes at {off} of a window's value file fail their CRC"
            )));
        }
        Ok(buf)
    }

    /// `fdatasync` the file.
    pub(crate) fn sync(&self) -> Result<(), StoreError> {
        self.file
            .sync_data()
            .map_err(|e| StoreError::io(IoOp::Sync, "fdatasync a window's value file", &e))
    }

    /// Bytes appended so far.
    #[cfg(test)]
    pub(crate) fn len(&self) -> u64 {
        self.end.lock().map_or(0, |e| *e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_read_back_through_their_pointers_also_after_reopen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = ValueFile::open(dir.path()).expect("open");
        let a = vec![7u8; 300];
        let b = b"second value".repeat(40);
        let ps = f.append(&[&a, &b]).expect("append");
        assert_eq!(ps.len(), 2);
        assert!(ps.iter().all(|p| is_pointer(p)));
        assert_eq!(f.read(&ps[0]).expect("a"), a);
        assert_eq!(f.read(&ps[1]).expect("b"), b);
        assert_eq!(f.len(), (a.len() + b.len()) as u64);
        drop(f);
        let f = ValueFile::open(dir.path()).expect("reopen");
        let c = vec![1u8; 500];
        let pc = f.append(&[&c]).expect("append after reopen");
        assert_eq!(f.read(&ps[1]).expect("b again"), b);
        assert_eq!(f.read(&pc[0]).expect("c"), c);
    }

    #[test]
    fn a_changed_byte_or_a_short_file_is_corrupt() {
        let dir = tempfile::tempdir().expect("tempdir");
        let f = ValueFile::open(dir.path()).expect("open");
        let ps = f.append(&[&[5u8; 400][..]]).expect("append");
        let path = dir.path().join(FILE_NAME);
        let mut bytes = std::fs::read(&path).expect("read");
        bytes[100] ^= 1;
        std::fs::write(&path, &bytes).expect("write");
        assert!(matches!(f.read(&ps[0]), Err(StoreError::Corrupt(_))));
        std::fs::write(&path, &bytes[..200]).expect("truncate");
        assert!(matches!(f.read(&ps[0]), Err(StoreError::Corrupt(_))));
        assert!(matches!(
            f.read(b"not a pointer"),
            Err(StoreError::Corrupt(_))
        ));
        // A length past the file's end is refused before anything is allocated.
        let mut huge = ps[0];
        huge[10..14].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(
            matches!(f.read(&huge), Err(StoreError::Corrupt(m)) if m.contains("pointer to")),
            "refused by the length check"
        );
    }
}
