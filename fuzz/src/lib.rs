//! Fuzz targets of turnd: their bodies live here so plain `cargo test` (on stable,
//! without cargo-fuzz) can replay the seeds and the kept regressions.
//!
//! - [`frames::frame_decode`]: the frame decoders of the server and the SDK.
//! - [`requests::run`]: request handling against a real engine on
//!   `turnd_store::mem::MemKv`.

pub mod frames;
pub mod requests;

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::requests::{Action, Json};

    /// Worker 0 says hello and registers function 0 (concurrency 1).
    fn hello_and_register() -> Vec<Action> {
        vec![
            Action::Hello {
                worker: 0,
                instance: 0,
                inflight: vec![],
                finished: vec![],
            },
            Action::Register {
                worker: 0,
                function: 0,
                concurrency: 1,
                timeout: 4,
                delivery: 2,
                max_attempts: 3,
            },
        ]
    }

    /// A small `turn.submit` to a session and a function (by index).
    fn submit(session: u8, function: u8) -> Action {
        Action::Submit {
            session,
            function,
            input: Json(serde_json::json!({"q": 1})),
            key: 0,
            timeout: 0,
        }
    }

    /// Every file under `dir/<target>` (seeds, kept regressions).
    fn inputs(dir: &str, target: &str) -> Vec<(String, Vec<u8>)> {
        let d = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir).join(target);
        let Ok(rd) = std::fs::read_dir(&d) else {
            return Vec::new();
        };
        let mut v: Vec<_> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.path().is_file())
            .filter(|e| e.file_name() != "README.md")
            .map(|e| {
                let p = e.path();
                (
                    p.display().to_string(),
                    std::fs::read(&p).expect("read input"),
                )
            })
            .collect();
        v.sort();
        v
    }

    #[test]
    fn frame_decode_seeds_run_clean() {
        for (name, data) in inputs("seeds", "frame_decode") {
            eprintln!("{name}");
            crate::frames::frame_decode(&data);
        }
    }

    /// Kept crashing inputs: each must run clean (see regressions/README.md).
    #[test]
    fn regressions_run_clean() {
        for (name, data) in inputs("regressions", "frame_decode") {
            eprintln!("{name}");
            crate::frames::frame_decode(&data);
        }
        for (name, data) in inputs("regressions", "requests") {
            eprintln!("{name}");
            crate::requests::run(&data);
        }
    }

    #[test]
    fn requests_seeds_run_clean() {
        for (name, data) in inputs("seeds", "requests") {
            eprintln!("{name}");
            crate::requests::run(&data);
        }
    }

    /// The harness reaches real state: a worker registers, a turn is dispatched to
    /// it, its result completes the turn, a restart recovers, and the checks pass.
    #[test]
    fn requests_harness_drives_a_turn_to_completion() {
        use crate::requests::{run_actions, OutcomeChoice, Setup};
        let setup = Setup::default();
        let mut actions = hello_and_register();
        actions.extend([
            submit(0, 0),
            submit(0, 0),
            Action::Result {
                caller: 0,
                invocation: 0,
                outcome: OutcomeChoice::Continue(Json(serde_json::json!({"s": 2}))),
            },
            Action::Result {
                caller: 0,
                invocation: 1,
                outcome: OutcomeChoice::Complete(Json(serde_json::json!("done"))),
            },
            Action::Get { turn: 0 },
            Action::Advance { step: 7 },
            Action::Restart,
            Action::Hello {
                worker: 0,
                instance: 0,
                inflight: vec![2],
                finished: vec![],
            },
            Action::Stop {
                turn: 1,
                reason: true,
            },
            Action::Inspect { session: 0 },
            Action::Events {
                session: 0,
                after: 0,
                limit: 0,
            },
            Action::Check,
        ]);
        let r = run_actions(&setup, &actions);
        eprintln!("{r:#?}");
        assert_eq!(r.count("function.register", "ok"), 1);
        assert_eq!(r.count("turn.submit", "ok"), 2);
        assert_eq!(r.count("invocation.result", "ok"), 2);
        assert!(
            r.invocations >= 3,
            "continue and the second turn dispatch again"
        );
        assert_eq!(r.count("turn.stop", "ok"), 1);
        assert_eq!(r.count("session.inspect", "ok"), 1);
        assert_eq!(r.count("store.check", "ok"), 1);
    }

    /// The memory and registry checks run and see what they guard: reads of ids
    /// nobody used and a stopped turn to a function nobody serves leave no session
    /// behind, a worker's functions are forgotten after it left and the linger
    /// passed, and memory is checked after every action.
    #[test]
    fn requests_harness_checks_memory_and_the_registry() {
        use crate::requests::{run_actions, OutcomeChoice, Setup};
        let setup = Setup::default();
        let mut actions = hello_and_register();
        actions.extend([
            submit(0, 0),
            // A turn to a function nobody serves, on a fresh session, stopped.
            submit(0, 250),
            Action::Inspect { session: 245 },
            Action::List {
                session: 250,
                status: 0,
                limit: 0,
                before: 0,
            },
            Action::Events {
                session: 241,
                after: 0,
                limit: 0,
            },
            Action::StopSession {
                session: 242,
                reason: false,
            },
            Action::Watch {
                session: 243,
                turn: 0,
                which: 0,
                after: 0,
            },
            Action::Get { turn: 250 },
            Action::Result {
                caller: 0,
                invocation: 0,
                outcome: OutcomeChoice::Complete(Json(serde_json::json!("done"))),
            },
            Action::Advance { step: 8 },
        ]);
        let r = run_actions(&setup, &actions);
        eprintln!("{r:#?}");
        assert_eq!(r.count("turn.submit", "ok"), 2);
        assert_eq!(r.count("turn.stop", "ok"), 1);
        assert_eq!(r.count("invocation.result", "ok"), 1);
        assert_eq!(r.unknown_reads, 7, "six reads and the stopped submit");
        assert!(r.memory_checks > actions.len() as u64);
        assert!(r.registry_checked);
    }

    /// Pseudo-random inputs (a fixed xorshift stream), as a short stand-in for a
    /// fuzzing run on stable Rust.
    #[test]
    fn requests_random_inputs_run_clean() {
        let n: usize = std::env::var("TURND_FUZZ_RANDOM_INPUTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200);
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for i in 0..n {
            let len = 64 + (next() % 960) as usize;
            let data: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            eprintln!("random input {i}");
            crate::requests::run(&data);
        }
    }

    /// The float finding through the engine: the same submit, once with an integer
    /// above u64::MAX and once with the number as the daemon prints it, is one turn
    /// (deduplicated), not a `conflict`.
    #[test]
    fn idempotent_submit_survives_the_daemons_own_float_text() {
        use crate::requests::{run_actions, Setup};
        let setup = Setup::default();
        let submit = |id: u64, input: &str| Action::RawText {
            role: 2,
            text: format!(
                r#"{{"id":{id},"op":"turn.submit","args":{{"session_id":"s0","function_id":"f0","input":{input},"idempotency_key":"k0"}}}}"#
            ),
        };
        let actions = vec![
            submit(90, "118446744073709551615"),
            submit(91, "1.1844674407370955e+20"),
        ];
        let r = run_actions(&setup, &actions);
        assert_eq!(r.count("turn.submit", "ok"), 2, "{:?}", r.answers);
        assert_eq!(r.turns, 1);
    }
}
