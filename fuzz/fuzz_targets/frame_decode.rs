//! Frame decoding: any bytes, as the server (`decode_request`) and the SDK
//! (`decode_server_frame`) decode a text frame. See `turnd_fuzz::frames`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    turnd_fuzz::frames::frame_decode(data);
});
