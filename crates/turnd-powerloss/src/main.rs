//! `turnd-powerloss`: read a kept recording, and make again a disk state a power
//! loss may leave, by hand.
//!
//! A recording is a directory with the recorder's directory `ctl/` (its `journal`
//! and `stash/`) and the recorded tree as the process left it, `disk/`: what the
//! power-loss test keeps of every run with `POWERLOSS_KEEP` (`docs/powerloss.md`).
//! Files are known by their inodes: move a recording (`mv` on one file system), do
//! not copy it.
//!
//!     turnd-powerloss dump RECORDING
//!     turnd-powerloss state RECORDING POINT VARIANT SEED OUT [LIE...]
//!     turnd-powerloss script NAME ROOT [CUT_FLAG]
//!
//! `dump` lists every op with its index (a point is the moment before that op) and
//! time; `state` makes in OUT (which must not exist) the disk a power loss at POINT
//! leaves in VARIANT (`data-lost+names-lost`, `data-prefix+names-lost`,
//! `data-pages+names-prefix`, …) with the choices of SEED, the tree as `OUT/tree`:
//! the same disk the test made for that point, variant and seed. Each LIE is the
//! index of a sync (an `fsync`/`fdatasync` in `dump`) to count as never done, as a
//! planted bug's disk drops it. `script` runs one
//! of the fixed sequences of calls the crate's tests record ([`scripts`]).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use turnd_powerloss::state::{Dice, Recording, Variant};

mod scripts;

fn open(recording: &Path, work: &Path) -> Result<Recording, String> {
    Recording::open(
        &recording.join("ctl/journal"),
        &recording.join("disk"),
        &recording.join("ctl/stash"),
        work,
    )
    .map_err(|e| e.to_string())
}

fn scratch() -> PathBuf {
    std::env::temp_dir().join(format!("turnd-powerloss-{}", std::process::id()))
}

fn dump(recording: &Path) -> Result<(), String> {
    let work = scratch();
    let mut r = open(recording, &work)?;
    let n = r.model.ops.len();
    let mut lines = Vec::with_capacity(n);
    for i in (0..n).rev() {
        lines.push(format!("{i:>7} {:>16} {}", r.model.ops[i].0, r.describe(i)));
        r.rewind(i).map_err(|e| e.to_string())?;
    }
    for l in lines.iter().rev() {
        println!("{l}");
    }
    std::fs::remove_dir_all(&work).map_err(|e| format!("remove {work:?}: {e}"))
}

fn state(
    recording: &Path,
    point: &str,
    variant: &str,
    seed: &str,
    out: &Path,
    lies: &[&str],
) -> Result<(), String> {
    let lies: Vec<usize> = lies
        .iter()
        .map(|l| l.parse().map_err(|_| format!("LIE {l:?} is not a number")))
        .collect::<Result<_, _>>()?;
    let point: usize = point
        .parse()
        .map_err(|_| format!("POINT {point:?} is not a number"))?;
    let variant = Variant::parse(variant).ok_or_else(|| {
        let all: Vec<String> = Variant::ALL.iter().map(ToString::to_string).collect();
        format!("VARIANT {variant:?} is not one of {}", all.join(", "))
    })?;
    let seed: u64 = seed
        .parse()
        .map_err(|_| format!("SEED {seed:?} is not a number"))?;
    let work = scratch();
    let mut r = open(recording, &work)?;
    r.rewind(point).map_err(|e| e.to_string())?;
    let mut dice = Dice::new(seed);
    let loss = r
        .crash_state(
            variant,
            &|_, i| lies.contains(&i),
            &mut |n| dice.below(n),
            out,
        )
        .map_err(|e| e.to_string())?;
    println!(
        "{out:?}/tree: power loss before op {point} ({variant}, seed {seed}): {} of {} pending ops kept",
        loss.kept, loss.pending
    );
    for d in &loss.described {
        println!("  pending: {d}");
    }
    std::fs::remove_dir_all(&work).map_err(|e| format!("remove {work:?}: {e}"))
}

const USAGE: &str = "usage: turnd-powerloss dump RECORDING | state RECORDING POINT VARIANT SEED OUT [LIE...] | script NAME ROOT [CUT_FLAG]";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["dump", rec] => dump(Path::new(rec)),
        ["state", rec, point, variant, seed, out, lies @ ..] => {
            state(Path::new(rec), point, variant, seed, Path::new(out), lies)
        }
        ["script", name, root] => scripts::run(name, Path::new(root), None),
        ["script", name, root, flag] => scripts::run(name, Path::new(root), Some(Path::new(flag))),
        _ => Err(USAGE.into()),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("turnd-powerloss: {e}");
            ExitCode::FAILURE
        }
    }
}
