//! The recorder of `turnd-faultfs` and the crash states made from its journal, on
//! fixed scripts of calls (`turnd-powerloss script`) whose every outcome is known:
//! each state a power loss may leave is one of the states the script's syncs allow,
//! every allowed one is made for some seed, taking the run back to its start gives
//! the tree it started from, a cut stops the process between two calls, and what the
//! journal cannot undo fails the recording.

#![allow(
    clippy::too_many_lines,
    reason = "a test reads as one scenario from its setup to its last assertion"
)]

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};

use turnd_powerloss::model::{Model, Op};
use turnd_powerloss::state::{digest, Data, Dice, Names, Recording, Variant};

/// `libturnd_faultfs.so`: `TURND_FAULTFS_LIB`, else built with cargo.
fn faultfs() -> PathBuf {
    if let Some(p) = std::env::var_os("TURND_FAULTFS_LIB") {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let ok = Command::new(env!("CARGO"))
        .args(["build", "-p", "turnd-faultfs"])
        .current_dir(&root)
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "cargo build -p turnd-faultfs failed");
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or(root.join("target"), PathBuf::from);
    target.join("debug/libturnd_faultfs.so")
}

/// A recorded run of one script.
struct Run {
    dir: tempfile::TempDir,
    root: PathBuf,
    ctl: PathBuf,
    /// The tree before the script ran.
    initial: BTreeMap<String, String>,
    status: ExitStatus,
}

impl Run {
    /// Run `script` under the recorder in a fresh tree that `prepare` filled.
    fn record(script: &str, prepare: impl FnOnce(&Path)) -> Run {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().join("root");
        fs::create_dir(&root).expect("mkdir");
        let root = fs::canonicalize(&root).expect("canonicalize");
        let ctl = dir.path().join("ctl");
        prepare(&root);
        let initial = digest(&root).expect("digest");
        let status = Command::new(env!("CARGO_BIN_EXE_turnd-powerloss"))
            .args(["script", script])
            .arg(&root)
            .arg(ctl.join("cut"))
            .env("LD_PRELOAD", faultfs())
            .env("TURND_POWERLOSS_ROOT", &root)
            .env("TURND_POWERLOSS_DIR", &ctl)
            .status()
            .expect("run the script");
        Run {
            dir,
            root,
            ctl,
            initial,
            status,
        }
    }

    fn open(&self) -> Result<Recording, String> {
        Recording::open(
            &self.ctl.join("journal"),
            &self.root,
            &self.ctl.join("stash"),
            &self.dir.path().join("work"),
        )
        .map_err(|e| e.to_string())
    }

    /// The state a power loss at the recording's current point leaves in `variant`
    /// with `seed`: each file's bytes by path relative to the tree.
    fn state(
        &self,
        rec: &Recording,
        variant: Variant,
        seed: u64,
        lie: &dyn Fn(&Model, usize) -> bool,
    ) -> BTreeMap<String, Vec<u8>> {
        let out = self.dir.path().join(format!("state-{variant}-{seed}"));
        let mut dice = Dice::new(seed);
        rec.crash_state(variant, lie, &mut |n| dice.below(n), &out)
            .expect("crash state");
        let mut files = BTreeMap::new();
        for (path, kind) in digest(&out.join("tree")).expect("digest") {
            let bytes = if kind == "dir" {
                b"dir".to_vec()
            } else {
                fs::read(out.join("tree").join(&path)).expect("read")
            };
            files.insert(path, bytes);
        }
        fs::remove_dir_all(&out).expect("remove state");
        files
    }
}

fn honest(_: &Model, _: usize) -> bool {
    false
}

fn pages(p: &[u8]) -> Vec<u8> {
    p.iter().flat_map(|b| vec![*b; 4096]).collect()
}

/// What a state holds of `a`, as page letters ("ABA"), and its names at the top.
fn summary(files: &BTreeMap<String, Vec<u8>>) -> (String, BTreeSet<String>) {
    let a = files.get("a").map_or("-".into(), |b| {
        b.chunks(4096).map(|c| char::from(c[0])).collect::<String>()
    });
    let top = files.keys().filter(|k| !k.contains('/')).cloned().collect();
    (a, top)
}

fn names(list: &[&str]) -> BTreeSet<String> {
    list.iter().map(|s| (*s).to_string()).collect()
}

#[test]
fn every_state_of_a_scripted_run_is_one_its_syncs_allow_and_each_one_is_made() {
    let run = Run::record("basic", |root| {
        fs::write(root.join("old"), b"OLD").expect("old");
    });
    assert!(run.status.success(), "{:?}", run.status);
    let mut rec = run.open().expect("open the recording");

    // The prefixes of the root's changes after its last sync, in order.
    let tops = [
        names(&["a", "old"]),
        names(&["a", "old", "d"]),
        names(&["a", "old", "d", "spare.tmp"]),
        names(&["a", "old", "d", "spare"]),
        names(&["a", "d", "spare"]),
    ];
    for variant in Variant::ALL {
        let mut seen = BTreeSet::new();
        for seed in 0..48 {
            let files = run.state(&rec, variant, seed, &honest);
            let (a, top) = summary(&files);
            let allowed_a: &[&str] = match variant.data {
                Data::Lost => &["AAA"],
                Data::Prefix => &["AAA", "ABA", "ABC", "AB"],
                Data::Pages => &["AAA", "ABA", "AAC", "ABC", "AA", "AB"],
            };
            assert!(
                allowed_a.contains(&a.as_str()),
                "{variant} seed {seed}: a = {a}"
            );
            match variant.names {
                Names::Lost => assert_eq!(top, tops[0], "{variant} seed {seed}"),
                Names::Prefix => assert!(tops.contains(&top), "{variant} seed {seed}: {top:?}"),
            }
            // Synced data is whole wherever its name is.
            for (path, want) in [
                ("old", b"OLD".as_slice()),
                ("spare", b"S"),
                ("spare.tmp", b"S"),
                ("d/x", b"x"),
            ] {
                if let Some(got) = files.get(path) {
                    assert_eq!(got, want, "{variant} seed {seed}: {path}");
                }
            }
            if files.contains_key("d/x") {
                assert_eq!(variant.names, Names::Prefix, "d/x is never synced in d");
            }
            seen.insert((a, top, files.contains_key("d/x")));
        }
        let a_seen: BTreeSet<&str> = seen.iter().map(|(a, _, _)| a.as_str()).collect();
        let tops_seen: BTreeSet<&BTreeSet<String>> = seen.iter().map(|(_, t, _)| t).collect();
        let want_tops = if variant.names == Names::Prefix {
            tops.len()
        } else {
            1
        };
        let want_a = match variant.data {
            Data::Lost => 1,
            Data::Prefix => 4,
            Data::Pages => 6,
        };
        assert_eq!(a_seen.len(), want_a, "{variant}: {a_seen:?}");
        assert_eq!(tops_seen.len(), want_tops, "{variant}: {tops_seen:?}");
        if variant.names == Names::Prefix {
            assert!(seen.iter().any(|s| s.2), "{variant}: d/x never kept");
        }
    }
    // A disk that drops a's first fdatasync: its data never became durable.
    let first_sync = rec.model.sync_points()[0];
    let lie = move |_: &Model, i: usize| i == first_sync;
    let lost = Variant::ALL[0];
    assert_eq!(
        run.state(&rec, lost, 0, &lie).get("a").map(Vec::len),
        Some(0)
    );

    // Before the root's sync, a's name was not durable yet.
    let root_sync = rec
        .model
        .sync_points()
        .into_iter()
        .find(|&i| matches!(&rec.model.ops[i].1, Op::Sync { path, .. } if path.is_empty()))
        .expect("the root's sync");
    rec.rewind(root_sync).expect("rewind");
    let before = run.state(&rec, lost, 0, &honest);
    assert_eq!(summary(&before).1, names(&["old"]));
    assert_eq!(
        before.get("old").map(Vec::as_slice),
        Some(b"OLD".as_slice())
    );

    // Back to the start: the tree the script began with.
    rec.rewind(0).expect("rewind to the start");
    assert_eq!(digest(&rec.tree()).expect("digest"), run.initial);
    assert_eq!(pages(b"AB").len(), 8192);
}

#[test]
fn a_cut_stops_the_process_between_two_calls_with_the_journal_whole() {
    let run = Run::record("cut", |_| {});
    assert_eq!(run.status.signal(), Some(libc::SIGKILL), "{:?}", run.status);
    let rec = run.open().expect("open the recording");
    assert_eq!(rec.model.ops.last().map(|(_, op)| op), Some(&Op::Cut));
    assert!(!rec.model.torn_tail);
    assert_eq!(
        fs::read(run.root.join("before")).expect("before"),
        b"written"
    );
    assert!(
        !run.root.join("after").exists(),
        "the call after the cut ran"
    );
}

#[test]
fn a_change_the_journal_cannot_undo_fails_the_recording() {
    let run = Run::record("mmap", |_| {});
    assert!(run.status.success(), "{:?}", run.status);
    let err = run
        .open()
        .err()
        .expect("a writable shared mapping must not pass");
    assert!(err.contains("writable shared mapping of mapped"), "{err}");
}

#[test]
fn a_size_change_no_recorded_call_made_is_found_and_undone() {
    let run = Run::record("raw-fallocate", |_| {});
    assert!(run.status.success(), "{:?}", run.status);
    let rec = run.open().expect("open the recording");
    let grown: Vec<(u64, u64)> = rec
        .model
        .ops
        .iter()
        .filter_map(|(_, op)| match op {
            Op::SetLen {
                old_size, new_size, ..
            } => Some((*old_size, *new_size)),
            _ => None,
        })
        .collect();
    assert_eq!(grown, vec![(0, 65536), (0, 65536)]);
    let mut lens = BTreeSet::new();
    for variant in Variant::ALL {
        for seed in 0..48 {
            let files = run.state(&rec, variant, seed, &honest);
            assert_eq!(files.get("synced").map(Vec::len), Some(65536), "{variant}");
            match files.get("unsynced") {
                None => {}
                Some(b) if variant.data == Data::Lost => assert!(b.is_empty(), "{variant}"),
                Some(b) => {
                    lens.insert(b.len());
                }
            }
        }
    }
    assert_eq!(lens, BTreeSet::from([0, 65536]));
}
