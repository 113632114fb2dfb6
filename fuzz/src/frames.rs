//! The `frame_decode` target's body: the decoders the daemon and the SDK run on every
//! text frame they receive.

use turnd_proto::frame::{
    decode_server_frame, encode_error, encode_ok, encode_request, ServerFrame,
};
use turnd_proto::{decode_raw_request, decode_request};

// Numbers are compared exactly: since the workspace builds serde_json with
// `float_roundtrip` (bf6cf56), every f64 survives decode -> encode -> decode bit for
// bit. Before that, this target found them drifting by one ULP; those inputs are
// kept in `regressions/frame_decode/`.

/// Decode `data` (when it is UTF-8, as a WebSocket text frame always is) both as a
/// request (what the server does) and as a server frame (what the SDK does).
///
/// Properties: neither decoder panics; a decoded request re-encoded with
/// `encode_request` decodes to the same request; a decoded server frame re-encoded
/// with the server's own encoders decodes to the same frame.
pub fn frame_decode(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };

    // The server decodes with `decode_raw_request`; `decode_request` is it plus a parse
    // of `args`, which must never refuse what the raw decoder accepted.
    assert_eq!(
        decode_raw_request(text).is_ok(),
        decode_request(text).is_ok(),
        "the raw and the parsed request decoders disagree on {text:?}"
    );
    match decode_request(text) {
        Ok(req) => {
            assert!(
                req.args.is_object(),
                "decode_request returned non-object args: {:?}",
                req.args
            );
            let again = encode_request(req.id, &req.op, &req.args);
            let back = decode_request(&again).unwrap_or_else(|e| {
                panic!("re-encoded request does not decode: {e:?}\noriginal: {req:?}\nencoded: {again}")
            });
            assert!(
                back == req,
                "request changed across encode/decode\n  before: {req:?}\n  after:  {back:?}\nencoded: {again}"
            );
        }
        Err(fe) => {
            assert!(!fe.message.is_empty(), "frame error without a message");
        }
    }

    if let Ok(frame) = decode_server_frame(text) {
        let again = match &frame {
            ServerFrame::Ok { id, ok } => encode_ok(*id, ok),
            ServerFrame::Error { id, error } => encode_error(*id, error),
            ServerFrame::Push(p) => serde_json::to_string(p).expect("a push serializes"),
        };
        let back = decode_server_frame(&again).unwrap_or_else(|e| {
            panic!("re-encoded server frame does not decode: {e}\noriginal: {frame:?}\nencoded: {again}")
        });
        assert!(
            back == frame,
            "server frame changed across encode/decode\n  before: {frame:?}\n  after:  {back:?}\nencoded: {again}"
        );
    }
}
