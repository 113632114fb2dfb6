//! The power-loss recorder: a journal of every change under one directory tree, for
//! a test to roll the tree back to what a power loss may leave.
//!
//! On when `TURND_POWERLOSS_ROOT` (the tree: the daemon's data directory or one
//! above it, as `realpath` gives it) and `TURND_POWERLOSS_DIR` (the recorder's own
//! directory, outside the tree) are set. The journal is `DIR/journal` (the format:
//! `turnd_powerloss::journal`); `DIR/stash/` keeps, as a hard link, every file whose
//! name is removed (unlinked, or replaced by a rename), so that it can be named again
//! and no inode number is reused while recording.
//!
//! Each recorded call, from any thread, holds one lock from the reading of its undo
//! data (the bytes a write will replace, read with `pread`; the state of a name) over
//! the call itself to the writing of its entry, so the journal's order is the order
//! of the changes. A sync is journaled before it starts and after it returns, without
//! the lock held while it runs. Calls on anything outside the tree go straight to the
//! C library; a thread already inside the recorder (its own `write`s, `open`s, …)
//! does too.
//!
//! **The cut.** While the file `DIR/cut` exists, the next recorded call (before it
//! does anything) journals [`Entry::Cut`] and kills the process with SIGKILL, still
//! holding the lock: the process dies at a boundary between two recorded calls, with
//! its journal whole, as a power loss would stop the machine.
//!
//! What is interposed, and why exactly that: `docs/powerloss.md`.

use std::cell::Cell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::sync::{Mutex, MutexGuard, OnceLock};

use turnd_powerloss::journal::{self, Entry, Old};

/// The recorder's settings and journal; None when not recording.
pub struct Recorder {
    /// `realpath` of the tree, without a trailing slash.
    root: Vec<u8>,
    stash: Vec<u8>,
    cut_flag: CString,
    journal: c_int,
    state: Mutex<State>,
}

#[derive(Default)]
pub struct State {
    next_stash: u64,
    next_sync: u64,
}

thread_local! {
    /// Set while this thread runs recorder code: its own calls go straight through.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// This thread is inside the recorder until dropped.
pub struct Busy(());

impl Drop for Busy {
    fn drop(&mut self) {
        let _ = BUSY.try_with(|b| b.set(false));
    }
}

fn enter() -> Option<Busy> {
    BUSY.try_with(|b| {
        if b.get() {
            None
        } else {
            b.set(true);
            Some(Busy(()))
        }
    })
    .ok()
    .flatten()
}

/// The recorder, if recording and this thread is not inside it already: then the
/// guard keeps this thread's own calls out of it.
pub fn active() -> Option<(&'static Recorder, Busy)> {
    let busy = enter()?;
    let r = recorder()?;
    Some((r, busy))
}

fn recorder() -> Option<&'static Recorder> {
    static REC: OnceLock<Option<Recorder>> = OnceLock::new();
    REC.get_or_init(Recorder::from_env).as_ref()
}

/// The calling thread's `errno`.
pub fn errno() -> c_int {
    // SAFETY: `__errno_location` returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() }
}

pub fn set_errno(v: c_int) {
    // SAFETY: as in `errno`.
    unsafe { *libc::__errno_location() = v };
}

/// `fstat` of `fd`.
pub fn fstat(fd: c_int) -> Option<libc::stat64> {
    // SAFETY: `st` is written by the call before it is read; any fd may be passed.
    unsafe {
        let mut st: libc::stat64 = std::mem::zeroed();
        (libc::fstat64(fd, &mut st) == 0).then_some(st)
    }
}

/// `lstat` of `path`.
pub fn lstat(path: &[u8]) -> Option<libc::stat64> {
    let c = CString::new(path).ok()?;
    // SAFETY: `c` is NUL-terminated; `st` is written before it is read.
    unsafe {
        let mut st: libc::stat64 = std::mem::zeroed();
        (libc::lstat64(c.as_ptr(), &mut st) == 0).then_some(st)
    }
}

pub fn is_dir(st: &libc::stat64) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFDIR
}

pub fn is_file(st: &libc::stat64) -> bool {
    st.st_mode & libc::S_IFMT == libc::S_IFREG
}

pub fn size_of(st: &libc::stat64) -> u64 {
    u64::try_from(st.st_size).unwrap_or(0)
}

fn readlink(link: &[u8]) -> Option<Vec<u8>> {
    let c = CString::new(link).ok()?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: `c` is NUL-terminated and `buf` writable for its length.
    let n = unsafe { libc::readlink(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    buf.truncate(usize::try_from(n).ok()?);
    Some(buf)
}

/// `path` (from `dirfd`, as the `*at` calls take it) made absolute and lexically
/// normal (no `.`, `..` or repeated `/`).
///
/// # Safety
///
/// `path` is null or a NUL-terminated string.
pub unsafe fn absolute(dirfd: c_int, path: *const c_char) -> Option<Vec<u8>> {
    if path.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    let p = unsafe { CStr::from_ptr(path) }.to_bytes();
    let joined = if p.first() == Some(&b'/') {
        p.to_vec()
    } else {
        let mut base = if dirfd == libc::AT_FDCWD {
            readlink(b"/proc/self/cwd")?
        } else {
            readlink(format!("/proc/self/fd/{dirfd}").as_bytes())?
        };
        base.push(b'/');
        base.extend_from_slice(p);
        base
    };
    let mut parts: Vec<&[u8]> = Vec::new();
    for part in joined.split(|b| *b == b'/') {
        match part {
            b"" | b"." => {}
            b".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    let mut out = Vec::with_capacity(joined.len());
    for part in parts {
        out.push(b'/');
        out.extend_from_slice(part);
    }
    if out.is_empty() {
        out.push(b'/');
    }
    Some(out)
}

/// `path`'s directory and last component.
pub fn split(path: &[u8]) -> (&[u8], &[u8]) {
    match path.iter().rposition(|b| *b == b'/') {
        Some(0) => (b"/", &path[1..]),
        Some(i) => (&path[..i], &path[i + 1..]),
        None => (b".", path),
    }
}

impl Recorder {
    fn from_env() -> Option<Recorder> {
        let root = std::env::var_os("TURND_POWERLOSS_ROOT")?;
        let dir = std::env::var_os("TURND_POWERLOSS_DIR")?;
        use std::os::unix::ffi::OsStrExt;
        let root = std::fs::canonicalize(root).ok()?;
        let dir = dir.as_bytes().to_vec();
        let stash = [dir.as_slice(), b"/stash"].concat();
        if let Err(e) = std::fs::create_dir_all(std::ffi::OsStr::from_bytes(&stash)) {
            eprintln!("turnd-faultfs: cannot make the recorder's stash: {e}");
            return None;
        }
        let journal_path = CString::new([dir.as_slice(), b"/journal"].concat()).ok()?;
        // SAFETY: the path is NUL-terminated.
        let fd = unsafe {
            libc::open(
                journal_path.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_APPEND | libc::O_CLOEXEC,
                0o644,
            )
        };
        if fd < 0 {
            eprintln!("turnd-faultfs: cannot open the recorder's journal");
            return None;
        }
        let r = Recorder {
            root: root.as_os_str().as_bytes().to_vec(),
            stash,
            cut_flag: CString::new([dir.as_slice(), b"/cut"].concat()).ok()?,
            journal: fd,
            state: Mutex::new(State::default()),
        };
        if fstat(fd).is_some_and(|st| st.st_size == 0) {
            r.append_raw(journal::MAGIC);
        }
        Some(r)
    }

    /// The path of `abs` relative to the tree, if it is in it.
    pub fn relative<'a>(&self, abs: &'a [u8]) -> Option<&'a [u8]> {
        let rest = abs.strip_prefix(self.root.as_slice())?;
        match rest.first() {
            None => Some(rest),
            Some(b'/') => Some(&rest[1..]),
            Some(_) => None,
        }
    }

    /// The path of the file `fd` is open on, relative to the tree, if it is in it
    /// (named or not: a removed name reads as `… (deleted)`).
    pub fn tracked(&self, fd: c_int) -> Option<Vec<u8>> {
        let target = readlink(format!("/proc/self/fd/{fd}").as_bytes())?;
        let target = target
            .strip_suffix(b" (deleted)")
            .map_or(target.clone(), <[u8]>::to_vec);
        self.relative(&target).map(<[u8]>::to_vec)
    }

    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn append_raw(&self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            // SAFETY: `bytes` is readable for its length.
            let n = unsafe { libc::write(self.journal, bytes.as_ptr().cast(), bytes.len()) };
            match usize::try_from(n) {
                Ok(n) if n > 0 => bytes = &bytes[n..],
                _ if errno() == libc::EINTR => {}
                _ => {
                    eprintln!("turnd-faultfs: the recorder's journal cannot be written");
                    // SAFETY: ends the process; the journal would be wrong from here.
                    unsafe { libc::abort() };
                }
            }
        }
    }

    /// Journal `entry` now (the caller holds the lock).
    pub fn log(&self, _held: &State, entry: &Entry) {
        self.append_raw(&journal::encode(journal::now_ns(), entry));
    }

    /// If the cut flag exists: journal the cut and die (the caller holds the lock).
    pub fn maybe_cut(&self, held: &State) {
        // SAFETY: the flag path is NUL-terminated.
        if unsafe { libc::access(self.cut_flag.as_ptr(), libc::F_OK) } != 0 {
            return;
        }
        self.log(held, &Entry::Cut);
        // SAFETY: kills this process; nothing after it runs.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
            loop {
                libc::pause();
            }
        }
    }

    /// A new stash number, and the stash path it names.
    pub fn stash_path(&self, state: &mut State) -> (u64, Vec<u8>) {
        let n = state.next_stash;
        state.next_stash += 1;
        let mut p = self.stash.clone();
        p.extend_from_slice(format!("/{n}").as_bytes());
        (n, p)
    }

    pub fn next_sync(&self, state: &mut State) -> u64 {
        state.next_sync += 1;
        state.next_sync
    }
}

/// Up to `len` bytes of `fd`'s file at `off` (fewer at its end), read without moving
/// its position: with `pread`, or through `/proc/self/fd` when `fd` is write-only.
pub fn read_at(fd: c_int, off: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; usize::try_from(len).unwrap_or(0)];
    let Ok(at) = i64::try_from(off) else {
        return Vec::new();
    };
    let pread = |fd: c_int, buf: &mut [u8]| -> Option<usize> {
        let mut got = 0;
        while got < buf.len() {
            // SAFETY: `buf[got..]` is writable for its length.
            let n = unsafe {
                libc::pread64(
                    fd,
                    buf[got..].as_mut_ptr().cast(),
                    buf.len() - got,
                    at + got as i64,
                )
            };
            match usize::try_from(n) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(_) if errno() == libc::EINTR => {}
                Err(_) => return None,
            }
        }
        Some(got)
    };
    let got = pread(fd, &mut buf).or_else(|| {
        let link = CString::new(format!("/proc/self/fd/{fd}")).ok()?;
        // SAFETY: `link` is NUL-terminated; the fd is closed below.
        let ro = unsafe { libc::open(link.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
        if ro < 0 {
            return None;
        }
        let got = pread(ro, &mut buf);
        // SAFETY: `ro` was opened above.
        unsafe { libc::close(ro) };
        got
    });
    buf.truncate(got.unwrap_or(0));
    buf
}

/// The recorder with its lock held and the cut checked, and the regular file of the
/// tree `fd` is open on: the start of recording a change of a file. None when the
/// call goes straight to the C library. `errno` is as it was.
fn enter_file(
    fd: c_int,
) -> Option<(
    &'static Recorder,
    Busy,
    MutexGuard<'static, State>,
    libc::stat64,
)> {
    let (rec, busy) = active()?;
    rec.tracked(fd)?;
    let saved = errno();
    let state = rec.lock();
    rec.maybe_cut(&state);
    let st = fstat(fd).filter(is_file);
    set_errno(saved);
    Some((rec, busy, state, st?))
}

/// Record a write of up to `len` bytes to `fd` at `at` (None: at its position, or at
/// its end when opened `O_APPEND`) made by `real`, which returns the bytes written.
pub fn write(fd: c_int, at: Option<i64>, len: usize, real: impl FnOnce() -> isize) -> isize {
    let Some((rec, _busy, state, st)) = enter_file(fd) else {
        return real();
    };
    let saved = errno();
    let old_size = size_of(&st);
    let off = match at {
        Some(o) => u64::try_from(o).unwrap_or(0),
        // SAFETY: any fd may be passed to fcntl and lseek.
        None if unsafe { libc::fcntl(fd, libc::F_GETFL) } & libc::O_APPEND != 0 => old_size,
        None => u64::try_from(unsafe { libc::lseek64(fd, 0, libc::SEEK_CUR) }).unwrap_or(0),
    };
    let overlap = old_size.saturating_sub(off).min(len as u64);
    let old = read_at(fd, off, overlap);
    set_errno(saved);
    let n = real();
    let after = errno();
    if let Ok(written) = u64::try_from(n) {
        if written > 0 {
            let mut old = old;
            old.truncate(usize::try_from(written.min(overlap)).unwrap_or(0));
            rec.log(
                &state,
                &Entry::Write {
                    ino: st.st_ino,
                    off,
                    len: written,
                    old_size,
                    old: Old::of(old),
                },
            );
        }
    }
    set_errno(after);
    n
}

/// Record a size change of `fd`'s file by `real` (which returns 0 on success):
/// `ftruncate` to `to`, or (`to` None) a `fallocate` that only grows it; the new size
/// is read back after the call.
pub fn resize(fd: c_int, to: Option<u64>, real: impl FnOnce() -> c_int) -> c_int {
    let Some((rec, _busy, state, before)) = enter_file(fd) else {
        return real();
    };
    let saved = errno();
    let old_size = size_of(&before);
    let tail = match to {
        Some(to) if to < old_size => read_at(fd, to, old_size - to),
        _ => Vec::new(),
    };
    set_errno(saved);
    let r = real();
    let after = errno();
    if let Some(st) = fstat(fd) {
        let new_size = size_of(&st);
        if new_size != old_size {
            rec.log(
                &state,
                &Entry::SetLen {
                    ino: st.st_ino,
                    old_size,
                    new_size,
                    tail: Old::of(if new_size < old_size {
                        tail
                    } else {
                        Vec::new()
                    }),
                },
            );
        }
    }
    set_errno(after);
    r
}

/// Record `fsync` (or, `data_only`, `fdatasync`) of `fd` by `real`.
pub fn sync(fd: c_int, data_only: bool, real: impl FnOnce() -> c_int) -> c_int {
    let Some((rec, busy)) = active() else {
        return real();
    };
    let Some(path) = rec.tracked(fd) else {
        drop(busy);
        return real();
    };
    let saved = errno();
    let id = {
        let mut state = rec.lock();
        rec.maybe_cut(&state);
        let Some(st) = fstat(fd) else {
            drop(state);
            set_errno(saved);
            return real();
        };
        let id = rec.next_sync(&mut state);
        rec.log(
            &state,
            &Entry::SyncBegin {
                ino: st.st_ino,
                id,
                data_only,
                dir: is_dir(&st),
                size: size_of(&st),
                path,
            },
        );
        id
    };
    set_errno(saved);
    let r = real();
    let after = errno();
    let state = rec.lock();
    rec.log(&state, &Entry::SyncEnd { id, ok: r == 0 });
    drop(state);
    set_errno(after);
    r
}

/// Journal that something under the tree happened that the journal cannot describe.
pub fn unmodeled(rec: &Recorder, what: String) {
    let state = rec.lock();
    rec.log(&state, &Entry::Unmodeled { what });
}
