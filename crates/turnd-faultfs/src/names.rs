//! The recorder's part of the calls that create, remove and rename names, and of the
//! calls that would change files in ways the journal does not describe.
//!
//! Every call here goes to the C library unchanged when the power-loss recorder is
//! off ([`crate::recorder`]) or the path is outside its tree. Inside the tree:
//! `open`/`creat` with `O_CREAT` of a missing name journal a creation, with `O_TRUNC`
//! of a file holding bytes a size change (with the bytes); `mkdir`, `unlink`, `rmdir`
//! and `rename` journal their change, a removed or replaced file kept alive in the
//! stash first. A rename across directories or out of the tree, a hard or symbolic
//! link, a `truncate` by path, `copy_file_range` into a file, a writable shared
//! mapping of a file and `sync`/`syncfs` are journaled as unmodeled: the daemon makes
//! none of them, and a test fails if it ever does.

use std::ffi::{c_char, c_int, c_uint, c_void, CString};

use libc::{mode_t, off64_t, off_t, size_t, ssize_t};
use turnd_powerloss::journal::{Entry, Old};

use crate::recorder::{
    absolute, active, errno, fstat, is_dir, is_file, lstat, read_at, set_errno, size_of, split,
    unmodeled, Busy, Recorder,
};

/// The recorder and `path` (from `dirfd`) made absolute, when it is in the tree: the
/// start of recording a change of a name. None when the call goes straight to the C
/// library.
fn enter_path(dirfd: c_int, path: *const c_char) -> Option<(&'static Recorder, Busy, Vec<u8>)> {
    let (rec, busy) = active()?;
    // SAFETY: `path` comes from the interposed call, under its contract.
    let abs = unsafe { absolute(dirfd, path) }?;
    rec.relative(&abs)?;
    Some((rec, busy, abs))
}

/// `open`/`openat`/`creat` of `path` from `dirfd` with `flags`, made by `real`.
fn open_at(dirfd: c_int, path: *const c_char, flags: c_int, real: impl FnOnce() -> c_int) -> c_int {
    if flags & (libc::O_CREAT | libc::O_TRUNC) == 0 && flags & libc::O_TMPFILE != libc::O_TMPFILE {
        return real();
    }
    let Some((rec, _busy, abs)) = enter_path(dirfd, path) else {
        return real();
    };
    if flags & libc::O_TMPFILE == libc::O_TMPFILE {
        unmodeled(
            rec,
            format!("O_TMPFILE open in {}", String::from_utf8_lossy(&abs)),
        );
        return real();
    }
    let saved = errno();
    let state = rec.lock();
    rec.maybe_cut(&state);
    let before = lstat(&abs);
    let (dir, name) = split(&abs);
    let parent = lstat(dir);
    // The bytes an O_TRUNC open will cut off, read before it.
    let tail = match &before {
        Some(st) if is_file(st) && flags & libc::O_TRUNC != 0 && st.st_size > 0 => {
            read_path(&abs, size_of(st))
        }
        _ => Vec::new(),
    };
    set_errno(saved);
    let fd = real();
    let after = errno();
    if fd >= 0 {
        let now = fstat(fd);
        match (&before, &parent, &now) {
            (None, Some(p), Some(st)) => rec.log(
                &state,
                &Entry::Create {
                    parent: p.st_ino,
                    name: name.to_vec(),
                    ino: st.st_ino,
                },
            ),
            (Some(b), _, Some(st)) if is_file(b) && size_of(st) < size_of(b) => rec.log(
                &state,
                &Entry::SetLen {
                    ino: st.st_ino,
                    old_size: size_of(b),
                    new_size: size_of(st),
                    tail: Old::of(tail),
                },
            ),
            _ => {}
        }
    }
    set_errno(after);
    fd
}

/// The first `len` bytes of the file at `path`.
fn read_path(path: &[u8], len: u64) -> Vec<u8> {
    let Ok(c) = CString::new(path) else {
        return Vec::new();
    };
    // SAFETY: `c` is NUL-terminated; the fd is closed below.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Vec::new();
    }
    let bytes = read_at(fd, 0, len);
    // SAFETY: `fd` was opened above.
    unsafe { libc::close(fd) };
    bytes
}

/// `mkdir` of `path` from `dirfd`, made by `real`.
fn mkdir_at(dirfd: c_int, path: *const c_char, real: impl FnOnce() -> c_int) -> c_int {
    let Some((rec, _busy, abs)) = enter_path(dirfd, path) else {
        return real();
    };
    let saved = errno();
    let state = rec.lock();
    rec.maybe_cut(&state);
    let (dir, name) = split(&abs);
    let parent = lstat(dir);
    set_errno(saved);
    let r = real();
    let after = errno();
    if let (0, Some(p), Some(st)) = (r, parent, lstat(&abs)) {
        rec.log(
            &state,
            &Entry::Mkdir {
                parent: p.st_ino,
                name: name.to_vec(),
                ino: st.st_ino,
            },
        );
    }
    set_errno(after);
    r
}

/// Remove the name `path` from `dirfd` (`dir`: a directory), by `real`.
fn remove_at(dirfd: c_int, path: *const c_char, dir: bool, real: impl FnOnce() -> c_int) -> c_int {
    let Some((rec, _busy, abs)) = enter_path(dirfd, path) else {
        return real();
    };
    let saved = errno();
    let mut state = rec.lock();
    rec.maybe_cut(&state);
    let (parent_path, name) = split(&abs);
    let (parent, node) = (lstat(parent_path), lstat(&abs));
    let stash = match &node {
        Some(st) if !dir && is_file(st) => Some(rec.stash_path(&mut state)),
        _ => None,
    };
    if let Some((_, to)) = &stash {
        stash_link(&abs, to);
    }
    set_errno(saved);
    let r = real();
    let after = errno();
    match (r, parent, node, stash) {
        (0, Some(p), Some(st), Some((n, _))) => rec.log(
            &state,
            &Entry::Unlink {
                parent: p.st_ino,
                name: name.to_vec(),
                ino: st.st_ino,
                stash: n,
            },
        ),
        (0, Some(p), Some(st), None) if is_dir(&st) => rec.log(
            &state,
            &Entry::Rmdir {
                parent: p.st_ino,
                name: name.to_vec(),
                ino: st.st_ino,
            },
        ),
        (0, ..) => rec.log(
            &state,
            &Entry::Unmodeled {
                what: format!("removal of {}", String::from_utf8_lossy(&abs)),
            },
        ),
        (_, _, _, Some((_, to))) => unlink_path(&to),
        _ => {}
    }
    set_errno(after);
    r
}

/// A hard link `to` of `from` (the stash), made or not: an unmade one shows as an
/// unknown stash entry, and the removal it was for as unmodeled.
fn stash_link(from: &[u8], to: &[u8]) {
    if let (Ok(f), Ok(t)) = (CString::new(from), CString::new(to)) {
        // SAFETY: both are NUL-terminated.
        if unsafe { libc::link(f.as_ptr(), t.as_ptr()) } != 0 {
            eprintln!(
                "turnd-faultfs: cannot keep {} in the stash",
                String::from_utf8_lossy(from)
            );
        }
    }
}

fn unlink_path(path: &[u8]) {
    if let Ok(c) = CString::new(path) {
        // SAFETY: NUL-terminated.
        unsafe { libc::unlink(c.as_ptr()) };
    }
}

/// `rename` of `old` (from `olddirfd`) to `new` (from `newdirfd`) with `flags`, by
/// `real`.
fn rename_at(
    olddirfd: c_int,
    old: *const c_char,
    newdirfd: c_int,
    new: *const c_char,
    flags: c_uint,
    real: impl FnOnce() -> c_int,
) -> c_int {
    let Some((rec, busy)) = active() else {
        return real();
    };
    // SAFETY: the paths come from the interposed call, under its contract.
    let paths = unsafe { (absolute(olddirfd, old), absolute(newdirfd, new)) };
    let (Some(from), Some(to)) = paths else {
        drop(busy);
        return real();
    };
    let inside = (rec.relative(&from).is_some(), rec.relative(&to).is_some());
    if inside == (false, false) {
        drop(busy);
        return real();
    }
    let ((from_dir, from_name), (to_dir, to_name)) = (split(&from), split(&to));
    if inside != (true, true) || from_dir != to_dir || flags & !libc::RENAME_NOREPLACE != 0 {
        unmodeled(
            rec,
            format!(
                "rename of {} to {} (flags {flags})",
                String::from_utf8_lossy(&from),
                String::from_utf8_lossy(&to)
            ),
        );
        return real();
    }
    let saved = errno();
    let mut state = rec.lock();
    rec.maybe_cut(&state);
    let (parent, node, target) = (lstat(from_dir), lstat(&from), lstat(&to));
    let stash = match &target {
        Some(st) if is_file(st) => Some(rec.stash_path(&mut state)),
        _ => None,
    };
    if let Some((_, s)) = &stash {
        stash_link(&to, s);
    }
    set_errno(saved);
    let r = real();
    let after = errno();
    match (r, parent, node) {
        (0, _, _) if target.as_ref().is_some_and(|t| !is_file(t)) => rec.log(
            &state,
            &Entry::Unmodeled {
                what: format!("rename over the directory {}", String::from_utf8_lossy(&to)),
            },
        ),
        (0, Some(p), Some(st)) => rec.log(
            &state,
            &Entry::Rename {
                parent: p.st_ino,
                from: from_name.to_vec(),
                to: to_name.to_vec(),
                ino: st.st_ino,
                replaced: target.zip(stash.as_ref()).map(|(t, (n, _))| (t.st_ino, *n)),
            },
        ),
        _ => {
            if let Some((_, s)) = &stash {
                unlink_path(s);
            }
        }
    }
    set_errno(after);
    r
}

/// Journal as unmodeled a call on `path` (from `dirfd`) inside the tree.
fn unmodeled_at(dirfd: c_int, path: *const c_char, what: &str) {
    if let Some((rec, _busy, abs)) = enter_path(dirfd, path) {
        unmodeled(rec, format!("{what} {}", String::from_utf8_lossy(&abs)));
    }
}

/// Journal as unmodeled a call changing the file `fd` is open on, if in the tree.
fn unmodeled_fd(fd: c_int, what: &str) {
    let Some((rec, _busy)) = active() else { return };
    if let Some(path) = rec.tracked(fd) {
        unmodeled(rec, format!("{what} {}", String::from_utf8_lossy(&path)));
    }
}

fn with_recorder(f: impl FnOnce(&Recorder)) {
    if let Some((rec, _busy)) = active() {
        f(rec);
    }
}

type OpenFn = unsafe extern "C" fn(*const c_char, c_int, mode_t) -> c_int;
type OpenatFn = unsafe extern "C" fn(c_int, *const c_char, c_int, mode_t) -> c_int;
type CreatFn = unsafe extern "C" fn(*const c_char, mode_t) -> c_int;
type PathFn = unsafe extern "C" fn(*const c_char) -> c_int;
type PathModeFn = unsafe extern "C" fn(*const c_char, mode_t) -> c_int;
type AtPathModeFn = unsafe extern "C" fn(c_int, *const c_char, mode_t) -> c_int;
type AtPathFlagsFn = unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int;
type TwoPathsFn = unsafe extern "C" fn(*const c_char, *const c_char) -> c_int;
type RenameatFn = unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char) -> c_int;
type Renameat2Fn =
    unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char, c_uint) -> c_int;
type LinkatFn = unsafe extern "C" fn(c_int, *const c_char, c_int, *const c_char, c_int) -> c_int;
type SymlinkatFn = unsafe extern "C" fn(*const c_char, c_int, *const c_char) -> c_int;
type TruncateFn = unsafe extern "C" fn(*const c_char, off_t) -> c_int;
type Truncate64Fn = unsafe extern "C" fn(*const c_char, off64_t) -> c_int;
type CopyRangeFn =
    unsafe extern "C" fn(c_int, *mut off64_t, c_int, *mut off64_t, size_t, c_uint) -> ssize_t;
type SyncfsFn = unsafe extern "C" fn(c_int) -> c_int;
type SyncAllFn = unsafe extern "C" fn();

/// The C library's `name` of type `ty` called with `args`, or -1 with `ENOSYS`.
macro_rules! call {
    ($name:literal, $ty:ty, $($arg:expr),*) => {
        match real!($name, $ty) {
            // SAFETY: the caller passes the arguments it was given, under the C
            // library's contract for this call.
            Some(f) => unsafe { f($($arg),*) },
            None => crate::fail(libc::ENOSYS),
        }
    };
}

interpose! {
    /// `open`: the recorder's creations and truncations (see the module
    /// documentation). `mode` is read only with `O_CREAT`/`O_TMPFILE`, as the C
    /// library's variadic argument is.
    fn open(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
        open_at(libc::AT_FDCWD, path, flags, || call!("open", OpenFn, path, flags, mode))
    }

    /// `open64`: as `open`.
    fn open64(path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
        open_at(libc::AT_FDCWD, path, flags, || call!("open64", OpenFn, path, flags, mode))
    }

    /// `openat`: as `open`.
    fn openat(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
        open_at(dirfd, path, flags, || call!("openat", OpenatFn, dirfd, path, flags, mode))
    }

    /// `openat64`: as `open`.
    fn openat64(dirfd: c_int, path: *const c_char, flags: c_int, mode: mode_t) -> c_int {
        open_at(dirfd, path, flags, || call!("openat64", OpenatFn, dirfd, path, flags, mode))
    }

    /// `creat`: `open` with `O_CREAT | O_WRONLY | O_TRUNC`.
    fn creat(path: *const c_char, mode: mode_t) -> c_int {
        open_at(libc::AT_FDCWD, path, CREAT, || call!("creat", CreatFn, path, mode))
    }

    /// `creat64`: as `creat`.
    fn creat64(path: *const c_char, mode: mode_t) -> c_int {
        open_at(libc::AT_FDCWD, path, CREAT, || call!("creat64", CreatFn, path, mode))
    }

    /// `mkdir`.
    fn mkdir(path: *const c_char, mode: mode_t) -> c_int {
        mkdir_at(libc::AT_FDCWD, path, || call!("mkdir", PathModeFn, path, mode))
    }

    /// `mkdirat`.
    fn mkdirat(dirfd: c_int, path: *const c_char, mode: mode_t) -> c_int {
        mkdir_at(dirfd, path, || call!("mkdirat", AtPathModeFn, dirfd, path, mode))
    }

    /// `unlink`.
    fn unlink(path: *const c_char) -> c_int {
        remove_at(libc::AT_FDCWD, path, false, || call!("unlink", PathFn, path))
    }

    /// `unlinkat` (with `AT_REMOVEDIR`: a directory).
    fn unlinkat(dirfd: c_int, path: *const c_char, flags: c_int) -> c_int {
        let dir = flags & libc::AT_REMOVEDIR != 0;
        remove_at(dirfd, path, dir, || call!("unlinkat", AtPathFlagsFn, dirfd, path, flags))
    }

    /// `rmdir`.
    fn rmdir(path: *const c_char) -> c_int {
        remove_at(libc::AT_FDCWD, path, true, || call!("rmdir", PathFn, path))
    }

    /// `rename`.
    fn rename(old: *const c_char, new: *const c_char) -> c_int {
        let cwd = libc::AT_FDCWD;
        rename_at(cwd, old, cwd, new, 0, || call!("rename", TwoPathsFn, old, new))
    }

    /// `renameat`.
    fn renameat(od: c_int, old: *const c_char, nd: c_int, new: *const c_char) -> c_int {
        rename_at(od, old, nd, new, 0, || call!("renameat", RenameatFn, od, old, nd, new))
    }

    /// `renameat2` (`RENAME_NOREPLACE` recorded; other flags unmodeled).
    fn renameat2(
        od: c_int,
        old: *const c_char,
        nd: c_int,
        new: *const c_char,
        flags: c_uint,
    ) -> c_int {
        rename_at(od, old, nd, new, flags, || {
            call!("renameat2", Renameat2Fn, od, old, nd, new, flags)
        })
    }

    /// `link`: a second name in the tree is unmodeled.
    fn link(old: *const c_char, new: *const c_char) -> c_int {
        unmodeled_at(libc::AT_FDCWD, new, "hard link");
        call!("link", TwoPathsFn, old, new)
    }

    /// `linkat`: as `link`.
    fn linkat(
        od: c_int,
        old: *const c_char,
        nd: c_int,
        new: *const c_char,
        flags: c_int,
    ) -> c_int {
        unmodeled_at(nd, new, "hard link");
        call!("linkat", LinkatFn, od, old, nd, new, flags)
    }

    /// `symlink`: a symbolic link in the tree is unmodeled.
    fn symlink(target: *const c_char, path: *const c_char) -> c_int {
        unmodeled_at(libc::AT_FDCWD, path, "symbolic link");
        call!("symlink", TwoPathsFn, target, path)
    }

    /// `symlinkat`: as `symlink`.
    fn symlinkat(target: *const c_char, dirfd: c_int, path: *const c_char) -> c_int {
        unmodeled_at(dirfd, path, "symbolic link");
        call!("symlinkat", SymlinkatFn, target, dirfd, path)
    }

    /// `truncate`: by path, unmodeled in the tree.
    fn truncate(path: *const c_char, len: off_t) -> c_int {
        unmodeled_at(libc::AT_FDCWD, path, "truncate by path of");
        call!("truncate", TruncateFn, path, len)
    }

    /// `truncate64`: as `truncate`.
    fn truncate64(path: *const c_char, len: off64_t) -> c_int {
        unmodeled_at(libc::AT_FDCWD, path, "truncate by path of");
        call!("truncate64", Truncate64Fn, path, len)
    }

    /// `copy_file_range`: into a file of the tree, unmodeled.
    fn copy_file_range(
        fd_in: c_int,
        off_in: *mut off64_t,
        fd_out: c_int,
        off_out: *mut off64_t,
        len: size_t,
        flags: c_uint,
    ) -> ssize_t {
        unmodeled_fd(fd_out, "copy_file_range into");
        call!("copy_file_range", CopyRangeFn, fd_in, off_in, fd_out, off_out, len, flags)
    }

    /// `syncfs`: a sync of every file, which the model does not take.
    fn syncfs(fd: c_int) -> c_int {
        unmodeled_fd(fd, "syncfs of the file system of");
        call!("syncfs", SyncfsFn, fd)
    }

    /// `sync`: as `syncfs`.
    fn sync() -> () {
        with_recorder(|rec| unmodeled(rec, "sync of every file system".into()));
        if let Some(f) = real!("sync", SyncAllFn) {
            // SAFETY: `sync` takes nothing.
            unsafe { f() }
        }
    }

    /// `mmap`: a writable shared mapping of a file in the tree is unmodeled. Made with
    /// the system call itself: the allocator maps memory through here, also while the
    /// C library's own lookup of `mmap` would still be allocating.
    fn mmap(
        addr: *mut c_void,
        len: size_t,
        prot: c_int,
        flags: c_int,
        fd: c_int,
        off: off_t,
    ) -> *mut c_void {
        map(addr, len, prot, flags, fd, off)
    }

    /// `mmap64`: as `mmap` (`off64_t` and `off_t` are one type on 64-bit Linux).
    fn mmap64(
        addr: *mut c_void,
        len: size_t,
        prot: c_int,
        flags: c_int,
        fd: c_int,
        off: off64_t,
    ) -> *mut c_void {
        map(addr, len, prot, flags, fd, off)
    }
}

/// The flags `creat` opens with.
const CREAT: c_int = libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC;

/// Whether a mapping with `prot` and `flags` writes through to its file.
fn writes_through(prot: c_int, flags: c_int) -> bool {
    prot & libc::PROT_WRITE != 0 && flags & libc::MAP_SHARED != 0
}

/// `mmap` by the system call, a writable shared mapping of a file in the tree
/// journaled as unmodeled first.
fn map(
    addr: *mut c_void,
    len: size_t,
    prot: c_int,
    flags: c_int,
    fd: c_int,
    off: off_t,
) -> *mut c_void {
    if fd >= 0 && writes_through(prot, flags) {
        unmodeled_fd(fd, "writable shared mapping of");
    }
    // SAFETY: the caller's arguments, under mmap's contract; the system call sets
    // errno and returns MAP_FAILED (-1) on failure, as the C library's mmap does.
    unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, off) as *mut c_void }
}
