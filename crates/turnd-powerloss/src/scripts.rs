//! `turnd-powerloss script NAME ROOT`: fixed sequences of file system calls, run
//! under the recorder by the crate's own tests (`tests/recorder.rs`), which know what
//! each leaves on disk and so what every power loss during it may leave.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

type Io = std::io::Result<()>;

fn sync_dir(dir: &Path) -> Io {
    File::open(dir)?.sync_all()
}

/// The page of `byte`s at page `i` of a file.
pub fn page(byte: u8) -> Vec<u8> {
    vec![byte; 4096]
}

/// `a` written whole and synced with its name; then two of its pages rewritten and
/// a directory, a file in it, a spare renamed into place and a removal, none of them
/// synced; last a shrink of `a`. `old` is made by the test before the recording.
fn basic(root: &Path) -> Io {
    let a = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(root.join("a"))?;
    a.write_all_at(&[page(b'A'), page(b'A'), page(b'A')].concat(), 0)?;
    a.sync_data()?;
    sync_dir(root)?;
    a.write_all_at(&page(b'B'), 4096)?;
    a.write_all_at(&page(b'C'), 8192)?;
    fs::create_dir(root.join("d"))?;
    let x = File::create(root.join("d/x"))?;
    (&x).write_all(b"x")?;
    x.sync_all()?;
    fs::write(root.join("spare.tmp"), b"S")?;
    File::open(root.join("spare.tmp"))?.sync_all()?;
    fs::rename(root.join("spare.tmp"), root.join("spare"))?;
    fs::remove_file(root.join("old"))?;
    a.set_len(8192)
}

/// A write, then the cut flag made, then a write the cut must stop.
fn cut(root: &Path, flag: &Path) -> Io {
    fs::write(root.join("before"), b"written")?;
    fs::write(flag, b"")?;
    fs::write(root.join("after"), b"never")
}

/// A writable shared mapping of a file of the tree: unmodeled.
fn mmap(root: &Path) -> Io {
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(root.join("mapped"))?;
    f.set_len(4096)?;
    // SAFETY: a fresh mapping of an open file, unmapped below.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        );
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        p.cast::<u8>().write(1);
        libc::munmap(p, 4096);
    }
    Ok(())
}

/// A segment reserved with `fallocate` made as a system call of its own (as rustix
/// makes it), which no `LD_PRELOAD` library sees: synced; then a second one not.
fn raw_fallocate(root: &Path) -> Io {
    for (name, sync) in [("synced", true), ("unsynced", false)] {
        let f = File::create(root.join(name))?;
        // SAFETY: fallocate(fd, 0, 0, 64 KiB) on an open file.
        let r = unsafe { libc::syscall(libc::SYS_fallocate, f.as_raw_fd(), 0, 0i64, 65536i64) };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if sync {
            f.sync_all()?;
            sync_dir(root)?;
        }
    }
    Ok(())
}

/// Run the script `name` in `root` (`flag`: the recorder's cut flag).
pub fn run(name: &str, root: &Path, flag: Option<&Path>) -> Result<(), String> {
    let r = match (name, flag) {
        ("basic", _) => basic(root),
        ("cut", Some(flag)) => cut(root, flag),
        ("mmap", _) => mmap(root),
        ("raw-fallocate", _) => raw_fallocate(root),
        _ => return Err(format!("no script {name:?}")),
    };
    r.map_err(|e| format!("script {name}: {e}"))
}
