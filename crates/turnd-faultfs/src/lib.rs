//! A failing disk, and a recorder of what a power loss may take away, for durability
//! tests, as an `LD_PRELOAD` library.
//!
//! Loaded into the real `turnd` binary, it interposes the C library's `pwrite64`,
//! `pwrite`, `fdatasync` and `fsync`. The flag files in the directory named by
//! `TURND_FAULTFS_DIR` choose what fails:
//!
//! - `fail-writes`: every positioned write (how the commit log and sled write) fails
//!   with `EIO`;
//! - `disk-full`: every positioned write fails with `ENOSPC`, as on a full disk;
//! - `fail-syncs`: every `fdatasync` and `fsync` fails with `EIO`;
//! - `fail-db-writes`: a positioned write to a file named `db` (sled's main file,
//!   `DATA_DIR/db`, and a time window's) fails with `EIO`; the commit log
//!   (`DATA_DIR/log/…`), the disk probe (`DATA_DIR/write-probe`) and every other file
//!   are written as usual, so sled fails while the disk takes writes. The file's name
//!   is read (`/proc/self/fd/N`) only while the flag exists.
//! - `slow-syncs`: every `fdatasync` and `fsync` waits the number of milliseconds the
//!   file holds before it goes to the C library, as on a disk whose cache flushes
//!   stall.
//!
//! Otherwise each call goes to the C library unchanged. The flags are looked up on
//! every call (one `access` each; a sync also reads `slow-syncs` while it exists),
//! so a test switches the disk between working and failing while the daemon runs.
//! Nothing else is changed, and without `TURND_FAULTFS_DIR` the library fails
//! nothing.
//!
//! This is the layer below sled: a test with it sees what sled and the store writer
//! do with real I/O errors, which fault injection above the store (`FaultyKv`) cannot
//! show. Linux (glibc) only; elsewhere the library is empty.
//!
//! With `TURND_POWERLOSS_ROOT` and `TURND_POWERLOSS_DIR` set it also records, for
//! power-loss tests, every change to the files and directories under the root and
//! every sync of them ([`recorder`], [`names`]): for that it interposes as well every
//! other call of the C library that writes a file (`write`, `writev`, `pwritev*`),
//! changes its size (`ftruncate*`, `fallocate*`, `posix_fallocate*`) or a name
//! (`open*`/`creat*` with `O_CREAT` or `O_TRUNC`, `mkdir*`, `unlink*`, `rmdir`,
//! `rename*`), and those it only reports (`link*`, `symlink*`, `truncate*`,
//! `copy_file_range`, `mmap*`, `sync`, `syncfs`); without those variables each goes
//! to the C library unchanged.
#![cfg(target_os = "linux")]
#![cfg_attr(
    test,
    allow(
        clippy::too_many_lines,
        reason = "a test reads as one scenario from its setup to its last assertion"
    )
)]

use std::ffi::{c_int, c_void, CString};
use std::sync::OnceLock;
use std::time::Duration;

use libc::{iovec, off64_t, off_t, size_t, ssize_t};

/// The flag files, from `TURND_FAULTFS_DIR` (None: never fail).
struct Flags {
    writes: CString,
    full: CString,
    syncs: CString,
    db_writes: CString,
    slow_syncs: CString,
}

fn flags() -> Option<&'static Flags> {
    static FLAGS: OnceLock<Option<Flags>> = OnceLock::new();
    FLAGS
        .get_or_init(|| {
            let dir = std::env::var("TURND_FAULTFS_DIR").ok()?;
            Some(Flags {
                writes: CString::new(format!("{dir}/fail-writes")).ok()?,
                full: CString::new(format!("{dir}/disk-full")).ok()?,
                syncs: CString::new(format!("{dir}/fail-syncs")).ok()?,
                db_writes: CString::new(format!("{dir}/fail-db-writes")).ok()?,
                slow_syncs: CString::new(format!("{dir}/slow-syncs")).ok()?,
            })
        })
        .as_ref()
}

fn exists(path: &CString) -> bool {
    // SAFETY: `path` is a valid NUL-terminated string for the whole call, and
    // `__errno_location` returns the calling thread's errno slot; `access` sets errno
    // when the flag is absent, which must not leak into the interposed call.
    unsafe {
        let errno = libc::__errno_location();
        let saved = *errno;
        let found = libc::access(path.as_ptr(), libc::F_OK) == 0;
        *errno = saved;
        found
    }
}

fn failing(pick: fn(&Flags) -> &CString) -> bool {
    flags().is_some_and(|f| exists(pick(f)))
}

/// The real call's result; or -1 with `errno` set to `EIO` while the flag `pick`
/// names exists, or if the C library has no such function.
fn guarded<R: From<i8>>(pick: fn(&Flags) -> &CString, call: impl FnOnce() -> Option<R>) -> R {
    if !failing(pick) {
        if let Some(r) = call() {
            return r;
        }
    }
    fail(libc::EIO)
}

/// -1 with `errno` set to `code`.
pub(crate) fn fail<R: From<i8>>(code: c_int) -> R {
    // SAFETY: `__errno_location` returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() = code };
    R::from(-1)
}

/// A positioned write to `fd`: `ENOSPC` while `disk-full` exists, `EIO` while
/// `fail-db-writes` exists and `fd` is a file named `db`, else as [`guarded`] with
/// `fail-writes`.
fn write_guarded(fd: c_int, call: impl FnOnce() -> Option<ssize_t>) -> ssize_t {
    if failing(|f| &f.full) {
        return fail(libc::ENOSPC);
    }
    if failing(|f| &f.db_writes) && named_db(fd) {
        return fail(libc::EIO);
    }
    guarded(|f| &f.writes, call)
}

/// Whether `fd` is open on a file named `db` (its path from `/proc/self/fd/N`).
/// Allocates nothing; `errno` is left as it was.
fn named_db(fd: c_int) -> bool {
    use std::io::Write;
    let mut link = [0u8; 32];
    let mut w = &mut link[..];
    if write!(w, "/proc/self/fd/{fd}\0").is_err() {
        return false;
    }
    let mut target = [0u8; 4096];
    // SAFETY: `link` is NUL-terminated (written above) and `target` is writable for
    // its whole length; `__errno_location` returns the calling thread's errno slot,
    // restored so that a failed `readlink` does not leak into the interposed call.
    let n = unsafe {
        let errno = libc::__errno_location();
        let saved = *errno;
        let n = libc::readlink(
            link.as_ptr().cast(),
            target.as_mut_ptr().cast(),
            target.len(),
        );
        *errno = saved;
        n
    };
    usize::try_from(n)
        .ok()
        .and_then(|n| target.get(..n))
        .is_some_and(|path| path.ends_with(b"/db"))
}

/// The next definition of `name` (NUL-terminated) after this library: the C
/// library's.
pub(crate) fn next(name: &'static [u8]) -> *mut c_void {
    // SAFETY: `name` is NUL-terminated; RTLD_NEXT lookups have no other requirement.
    unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr().cast()) }
}

macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static REAL: ::std::sync::OnceLock<usize> = ::std::sync::OnceLock::new();
        let p = *REAL.get_or_init(|| $crate::next(concat!($name, "\0").as_bytes()) as usize);
        if p == 0 {
            None
        } else {
            // SAFETY: the symbol is the C library's function of this exact signature.
            Some(unsafe { std::mem::transmute::<usize, $ty>(p) })
        }
    }};
}

/// Interposed C library functions: each `fn name(args) -> ret { body }` exported
/// under its own name, for the C library's callers.
macro_rules! interpose {
    ($(
        $(#[doc = $doc:literal])*
        fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty $body:block
    )*) => {
        $(
            $(#[doc = $doc])*
            ///
            /// # Safety
            ///
            /// The C library's contract for this call.
            #[no_mangle]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret $body
        )*
    };
}

pub mod names;
pub mod recorder;

type PwriteFn = unsafe extern "C" fn(c_int, *const c_void, size_t, off_t) -> ssize_t;
type Pwrite64Fn = unsafe extern "C" fn(c_int, *const c_void, size_t, off64_t) -> ssize_t;
type SyncFn = unsafe extern "C" fn(c_int) -> c_int;

/// Interposed `pwrite64`: fails with `ENOSPC` while `disk-full` exists, with `EIO`
/// while `fail-writes` exists, or `fail-db-writes` and `fd` is a file named `db`.
///
/// # Safety
///
/// The C library's contract for `pwrite64`: `buf` points at `count` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn pwrite64(
    fd: c_int,
    buf: *const c_void,
    count: size_t,
    offset: off64_t,
) -> ssize_t {
    write_guarded(fd, || {
        real!("pwrite64", Pwrite64Fn)
            .map(|f| recorder::write(fd, Some(offset), count, || f(fd, buf, count, offset)))
    })
}

/// Interposed `pwrite`: fails with `ENOSPC` while `disk-full` exists, with `EIO`
/// while `fail-writes` exists, or `fail-db-writes` and `fd` is a file named `db`.
///
/// # Safety
///
/// The C library's contract for `pwrite`: `buf` points at `count` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn pwrite(
    fd: c_int,
    buf: *const c_void,
    count: size_t,
    offset: off_t,
) -> ssize_t {
    write_guarded(fd, || {
        real!("pwrite", PwriteFn)
            .map(|f| recorder::write(fd, Some(offset), count, || f(fd, buf, count, offset)))
    })
}

/// While `slow-syncs` exists, wait the milliseconds it holds (none if it holds no
/// number). `errno` is left as it was. Reading the file allocates and makes system
/// calls this library does not interpose, so it is not async-signal-safe: fine for
/// the daemon, which syncs only from its own threads.
fn stall_sync() {
    let Some(f) = flags() else { return };
    if !exists(&f.slow_syncs) {
        return;
    }
    // SAFETY: `__errno_location` returns the calling thread's errno slot, restored
    // so that reading the flag does not leak into the interposed call.
    let saved = unsafe { *libc::__errno_location() };
    let ms = f
        .slow_syncs
        .to_str()
        .ok()
        .and_then(|path| std::fs::read_to_string(path).ok())
        .and_then(|s| s.trim().parse::<u64>().ok());
    if let Some(ms) = ms {
        std::thread::sleep(Duration::from_millis(ms));
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved };
}

/// Interposed `fdatasync`: waits while `slow-syncs` exists, fails with `EIO` while
/// `fail-syncs` exists.
///
/// # Safety
///
/// None beyond the C library's: any `fd` may be passed.
#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    stall_sync();
    guarded(
        |f| &f.syncs,
        || real!("fdatasync", SyncFn).map(|f| recorder::sync(fd, true, || f(fd))),
    )
}

/// Interposed `fsync`: waits while `slow-syncs` exists, fails with `EIO` while
/// `fail-syncs` exists.
///
/// # Safety
///
/// None beyond the C library's: any `fd` may be passed.
#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    stall_sync();
    guarded(
        |f| &f.syncs,
        || real!("fsync", SyncFn).map(|f| recorder::sync(fd, false, || f(fd))),
    )
}

type WriteFn = unsafe extern "C" fn(c_int, *const c_void, size_t) -> ssize_t;
type WritevFn = unsafe extern "C" fn(c_int, *const iovec, c_int) -> ssize_t;
type PwritevFn = unsafe extern "C" fn(c_int, *const iovec, c_int, off_t) -> ssize_t;
type Pwritev2Fn = unsafe extern "C" fn(c_int, *const iovec, c_int, off_t, c_int) -> ssize_t;
type FtruncateFn = unsafe extern "C" fn(c_int, off_t) -> c_int;
type FallocateFn = unsafe extern "C" fn(c_int, c_int, off_t, off_t) -> c_int;
type PosixFallocateFn = unsafe extern "C" fn(c_int, off_t, off_t) -> c_int;

/// `real`'s result, or -1 with `ENOSYS` when the C library has no such function.
fn or_enosys<R: From<i8>>(real: Option<R>) -> R {
    real.unwrap_or_else(|| fail(libc::ENOSYS))
}

/// Bytes `iov[..n]` hold.
///
/// # Safety
///
/// `iov` points at `n` readable `iovec`s.
unsafe fn iov_len(iov: *const iovec, n: c_int) -> usize {
    let n = usize::try_from(n).unwrap_or(0);
    if iov.is_null() || n == 0 {
        return 0;
    }
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(iov, n) }
        .iter()
        .map(|v| v.iov_len)
        .sum()
}

/// The position a `pwritev2` with `off` and `flags` writes at (None: the file's
/// position, or its end).
fn pwritev2_at(off: off_t, flags: c_int) -> Option<i64> {
    (off != -1 && flags & libc::RWF_APPEND == 0).then_some(off)
}

/// A `fallocate` with `mode`: recorded as a size change when it may grow the file
/// (mode 0), passed through when it only reserves blocks (`FALLOC_FL_KEEP_SIZE`), and
/// unmodeled otherwise (punching or zeroing a range changes bytes).
fn fallocate_with(fd: c_int, mode: c_int, real: impl FnOnce() -> c_int) -> c_int {
    match mode {
        0 => recorder::resize(fd, None, real),
        libc::FALLOC_FL_KEEP_SIZE => real(),
        _ => {
            if let Some((rec, _busy)) = recorder::active() {
                if let Some(path) = rec.tracked(fd) {
                    recorder::unmodeled(
                        rec,
                        format!(
                            "fallocate mode {mode} of {}",
                            String::from_utf8_lossy(&path)
                        ),
                    );
                }
            }
            real()
        }
    }
}

interpose! {
    /// `write`: recorded by the power-loss recorder (see the crate documentation);
    /// never failed by the flags.
    fn write(fd: c_int, buf: *const c_void, count: size_t) -> ssize_t {
        or_enosys(
            real!("write", WriteFn).map(|f| recorder::write(fd, None, count, || f(fd, buf, count))),
        )
    }

    /// `writev`: as `write`.
    fn writev(fd: c_int, iov: *const iovec, n: c_int) -> ssize_t {
        // SAFETY: the caller's contract.
        let len = unsafe { iov_len(iov, n) };
        or_enosys(
            real!("writev", WritevFn).map(|f| recorder::write(fd, None, len, || f(fd, iov, n))),
        )
    }

    /// `pwritev`: as `write`, at `off`.
    fn pwritev(fd: c_int, iov: *const iovec, n: c_int, off: off_t) -> ssize_t {
        // SAFETY: the caller's contract.
        let len = unsafe { iov_len(iov, n) };
        or_enosys(
            real!("pwritev", PwritevFn)
                .map(|f| recorder::write(fd, Some(off), len, || f(fd, iov, n, off))),
        )
    }

    /// `pwritev64`: as `pwritev`.
    fn pwritev64(fd: c_int, iov: *const iovec, n: c_int, off: off64_t) -> ssize_t {
        // SAFETY: the caller's contract.
        let len = unsafe { iov_len(iov, n) };
        or_enosys(
            real!("pwritev64", PwritevFn)
                .map(|f| recorder::write(fd, Some(off), len, || f(fd, iov, n, off))),
        )
    }

    /// `pwritev2`: as `pwritev` (at the position for `off` -1).
    fn pwritev2(fd: c_int, iov: *const iovec, n: c_int, off: off_t, flags: c_int) -> ssize_t {
        // SAFETY: the caller's contract.
        let len = unsafe { iov_len(iov, n) };
        let at = pwritev2_at(off, flags);
        or_enosys(
            real!("pwritev2", Pwritev2Fn)
                .map(|f| recorder::write(fd, at, len, || f(fd, iov, n, off, flags))),
        )
    }

    /// `pwritev64v2`: as `pwritev2`.
    fn pwritev64v2(
        fd: c_int,
        iov: *const iovec,
        n: c_int,
        off: off64_t,
        flags: c_int,
    ) -> ssize_t {
        // SAFETY: the caller's contract.
        let len = unsafe { iov_len(iov, n) };
        let at = pwritev2_at(off, flags);
        or_enosys(
            real!("pwritev64v2", Pwritev2Fn)
                .map(|f| recorder::write(fd, at, len, || f(fd, iov, n, off, flags))),
        )
    }

    /// `ftruncate`: recorded as a size change.
    fn ftruncate(fd: c_int, len: off_t) -> c_int {
        let to = u64::try_from(len).ok();
        or_enosys(real!("ftruncate", FtruncateFn).map(|f| recorder::resize(fd, to, || f(fd, len))))
    }

    /// `ftruncate64`: as `ftruncate`.
    fn ftruncate64(fd: c_int, len: off64_t) -> c_int {
        let to = u64::try_from(len).ok();
        or_enosys(
            real!("ftruncate64", FtruncateFn).map(|f| recorder::resize(fd, to, || f(fd, len))),
        )
    }

    /// `fallocate` (see `fallocate_with`).
    fn fallocate(fd: c_int, mode: c_int, off: off_t, len: off_t) -> c_int {
        or_enosys(
            real!("fallocate", FallocateFn)
                .map(|f| fallocate_with(fd, mode, || f(fd, mode, off, len))),
        )
    }

    /// `fallocate64`: as `fallocate`.
    fn fallocate64(fd: c_int, mode: c_int, off: off64_t, len: off64_t) -> c_int {
        or_enosys(
            real!("fallocate64", FallocateFn)
                .map(|f| fallocate_with(fd, mode, || f(fd, mode, off, len))),
        )
    }

    /// `posix_fallocate`: a size change (it returns an error number).
    fn posix_fallocate(fd: c_int, off: off_t, len: off_t) -> c_int {
        match real!("posix_fallocate", PosixFallocateFn) {
            Some(f) => recorder::resize(fd, None, || f(fd, off, len)),
            None => libc::ENOSYS,
        }
    }

    /// `posix_fallocate64`: as `posix_fallocate`.
    fn posix_fallocate64(fd: c_int, off: off64_t, len: off64_t) -> c_int {
        match real!("posix_fallocate64", PosixFallocateFn) {
            Some(f) => recorder::resize(fd, None, || f(fd, off, len)),
            None => libc::ENOSYS,
        }
    }
}
