//! Request handling: a sequence of protocol requests from workers and callers against
//! a real engine on an in-memory store. See `turnd_fuzz::requests`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    turnd_fuzz::requests::run(data);
});
