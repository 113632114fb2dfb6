//! Envelopes: requests, responses, pushes, and the protocol's error codes.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// The whole set of protocol error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    BadFrame,
    BadRequest,
    UnknownOp,
    UnsupportedProtocol,
    NotAuthenticated,
    Forbidden,
    NotFound,
    Conflict,
    /// A submit with `on_busy: "reject"` found the session busy.
    Busy,
    TooLarge,
    RateLimited,
    Unavailable,
    ShuttingDown,
    Internal,
}

impl ErrorCode {
    /// Whether the protocol marks this code retryable.
    pub fn retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::RateLimited
                | ErrorCode::Unavailable
                | ErrorCode::ShuttingDown
                | ErrorCode::Internal
        )
    }

    /// The wire spelling of the code.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadFrame => "bad_frame",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::UnknownOp => "unknown_op",
            ErrorCode::UnsupportedProtocol => "unsupported_protocol",
            ErrorCode::NotAuthenticated => "not_authenticated",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::NotFound => "not_found",
            ErrorCode::Conflict => "conflict",
            ErrorCode::Busy => "busy",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Internal => "internal",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `error` member of a response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub code: ErrorCode,
    pub message: String,
    pub retryable: bool,
    /// Never on the wire: the request's write is in doubt (a replicated log stopped
    /// before it knew whether the write counts), so no answer may be sent for it, not
    /// even `unavailable`, which says nothing changed. The edge ends the connection
    /// instead, as a crash would ([`ErrorBody::in_doubt`]).
    #[serde(skip)]
    pub in_doubt: bool,
}

impl ErrorBody {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ErrorBody {
            code,
            message: message.into(),
            retryable: code.retryable(),
            in_doubt: false,
        }
    }

    /// An error that must not be answered: the request's write is in doubt.
    pub fn in_doubt(message: impl Into<String>) -> Self {
        ErrorBody {
            in_doubt: true,
            ..ErrorBody::new(ErrorCode::Unavailable, message)
        }
    }
}

impl std::fmt::Display for ErrorBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for ErrorBody {}

/// A decoded request envelope.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub id: u64,
    pub op: String,
    pub args: Value,
}

/// A request envelope whose `args` is still JSON text, borrowed from the frame: the
/// server decodes it straight into the op's typed arguments, without building a
/// `Value` tree of the whole frame first.
#[derive(Debug, Clone)]
pub struct RawRequest<'a> {
    pub id: u64,
    pub op: std::borrow::Cow<'a, str>,
    args: Option<&'a RawValue>,
}

impl<'a> RawRequest<'a> {
    /// The JSON text of `args`: an object (`{}` when absent or `null`).
    pub fn args_text(&self) -> &'a str {
        self.args.map_or("{}", RawValue::get)
    }
}

/// Why a frame could not be decoded into a [`Request`]; carries the `id` when one
/// could be read so the error response can echo it.
#[derive(Debug, Clone, PartialEq)]
pub struct FrameError {
    pub id: Option<u64>,
    pub message: String,
}

/// The members of a JSON object named in `names`, as their JSON text; other members
/// are skipped. A name given twice is refused: which of the two was meant is unknown.
struct Members<'n> {
    names: &'n [&'static str],
    /// Check the members not named as strictly as a parse into `Value` would (a
    /// request); otherwise only skip them (a server frame).
    strict: bool,
}

type Found<'de> = [Option<&'de RawValue>; 4];

impl<'de> serde::de::DeserializeSeed<'de> for Members<'_> {
    type Value = Found<'de>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Found<'de>, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Members<'_> {
    type Value = Found<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Found<'de>, A::Error> {
        let mut found: Found<'de> = [None; 4];
        while let Some(key) = map.next_key_seed(MemberName { names: self.names })? {
            match key {
                Some(i) => {
                    if found[i].is_some() {
                        return Err(serde::de::Error::custom(format_args!(
                            "duplicate member `{}`",
                            self.names[i]
                        )));
                    }
                    found[i] = Some(map.next_value()?);
                }
                None if self.strict => map.next_value_seed(Strict)?,
                None => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(found)
    }
}

/// A member name: its index in `names`, or `None` for any other name.
struct MemberName<'n> {
    names: &'n [&'static str],
}

impl<'de> serde::de::DeserializeSeed<'de> for MemberName<'_> {
    type Value = Option<usize>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Option<usize>, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> serde::de::Visitor<'de> for MemberName<'_> {
    type Value = Option<usize>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a member name")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Option<usize>, E> {
        Ok(self.names.iter().position(|n| *n == v))
    }
}

/// Read the members `names` (at most four) of the JSON object `text`, or say why it is
/// not one. With `strict`, the other members are checked as [`Strict`] does.
fn members<'a>(text: &'a str, names: &[&'static str], strict: bool) -> Result<Found<'a>, String> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    let found = Members { names, strict }
        .deserialize(&mut de)
        .and_then(|f| de.end().map(|()| f));
    found.map_err(|e| match e.classify() {
        serde_json::error::Category::Data => {
            if text.trim_start().starts_with('{') {
                format!("frame is not a valid envelope: {e}")
            } else if let Err(e) = check_json(text) {
                format!("frame is not valid JSON: {e}")
            } else {
                "frame is not a JSON object".into()
            }
        }
        _ => format!("frame is not valid JSON: {e}"),
    })
}

/// Any JSON value, read and dropped. Reading it checks all that a parse into `Value`
/// checks (string escapes, number range, nesting depth), without building anything:
/// the members of a request that are kept as text or skipped are held to the same
/// standard as before they were.
struct Strict;

impl<'de> serde::de::DeserializeSeed<'de> for Strict {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Strict {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E>(self, _: bool) -> Result<(), E> {
        Ok(())
    }
    fn visit_i64<E>(self, _: i64) -> Result<(), E> {
        Ok(())
    }
    fn visit_u64<E>(self, _: u64) -> Result<(), E> {
        Ok(())
    }
    fn visit_f64<E>(self, _: f64) -> Result<(), E> {
        Ok(())
    }
    fn visit_str<E>(self, _: &str) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Strict)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_key_seed(Strict)?.is_some() {
            map.next_value_seed(Strict)?;
        }
        Ok(())
    }
}

/// Check that `text` is one JSON value as strictly as a parse into `Value` would.
fn check_json(text: &str) -> Result<(), serde_json::Error> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    Strict.deserialize(&mut de)?;
    de.end()
}

/// The string `raw` holds, borrowed unless it has escapes; `None` if it is no string.
fn json_str(raw: &RawValue) -> Option<std::borrow::Cow<'_, str>> {
    match serde_json::from_str::<&str>(raw.get()) {
        Ok(s) => Some(s.into()),
        Err(_) => serde_json::from_str::<String>(raw.get())
            .ok()
            .map(Into::into),
    }
}

/// Decode one text frame into a request envelope whose `args` stays JSON text, or say
/// why it is a bad frame.
///
/// A frame is a request when it is a JSON object with a non-negative integer `id` and a
/// string `op`; `args`, when present, must be an object (absent or `null` means `{}`).
pub fn decode_raw_request(text: &str) -> Result<RawRequest<'_>, FrameError> {
    let [id, op, args, _] = members(text, &["id", "op", "args"], true)
        .map_err(|message| FrameError { id: None, message })?;
    // The members kept as text were only delimited so far: hold them to a full parse.
    for raw in [id, op, args].into_iter().flatten() {
        check_json(raw.get()).map_err(|e| FrameError {
            id: None,
            message: format!("frame is not valid JSON: {e}"),
        })?;
    }
    let Some(id) = id.and_then(|raw| serde_json::from_str::<u64>(raw.get()).ok()) else {
        return Err(FrameError {
            id: None,
            message: "frame has no non-negative integer `id`".into(),
        });
    };
    let Some(op) = op.and_then(json_str) else {
        return Err(FrameError {
            id: Some(id),
            message: "frame has no string `op`".into(),
        });
    };
    let args = match args {
        Some(raw) if raw.get() == "null" => None,
        Some(raw) if !raw.get().starts_with('{') => {
            return Err(FrameError {
                id: Some(id),
                message: "`args` must be a JSON object".into(),
            })
        }
        other => other,
    };
    Ok(RawRequest { id, op, args })
}

/// Decode one text frame into a request, or say why it is a bad frame (see
/// [`decode_raw_request`]), with `args` parsed.
pub fn decode_request(text: &str) -> Result<Request, FrameError> {
    let raw = decode_raw_request(text)?;
    // The envelope's `args` text was read as one valid JSON value.
    let args = serde_json::from_str(raw.args_text()).map_err(|e| FrameError {
        id: Some(raw.id),
        message: format!("`args` is not valid JSON: {e}"),
    })?;
    Ok(Request {
        id: raw.id,
        op: raw.op.into_owned(),
        args,
    })
}

/// Encode a success response.
pub fn encode_ok(id: u64, ok: &Value) -> String {
    #[derive(Serialize)]
    struct OkFrame<'a> {
        id: u64,
        ok: &'a Value,
    }
    // Written straight from the borrowed value: `json!` would copy the whole answer
    // into a new tree first. A `Value` always serializes.
    serde_json::to_string(&OkFrame { id, ok }).expect("a JSON value serializes")
}

/// Encode a success response whose answer is already JSON text.
pub fn encode_ok_raw(id: u64, ok: &serde_json::value::RawValue) -> String {
    encode_ok_text(id, ok.get())
}

/// Encode a success response whose answer is JSON text written by serde_json (as
/// [`to_json_text`] writes it): one allocation of the frame's size.
pub fn encode_ok_text(id: u64, ok: &str) -> String {
    // 20 digits of a u64 and the envelope's 14 bytes.
    let mut out = String::with_capacity(ok.len() + 34);
    out.push_str("{\"id\":");
    let mut digits = [0u8; 20];
    let mut i = digits.len();
    let mut n = id;
    loop {
        i -= 1;
        digits[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    out.extend(digits[i..].iter().map(|&d| char::from(d)));
    out.push_str(",\"ok\":");
    out.push_str(ok);
    out.push('}');
    out
}

/// The JSON text of `v`, written into a buffer of `capacity` bytes to start with:
/// `serde_json::to_string` starts from an empty buffer and reallocates it several
/// times for a frame of a few hundred bytes.
pub fn to_json_text<T: Serialize + ?Sized>(
    v: &T,
    capacity: usize,
) -> Result<String, serde_json::Error> {
    let mut buf = Vec::with_capacity(capacity);
    serde_json::to_writer(&mut buf, v)?;
    String::from_utf8(buf).map_err(|e| serde::ser::Error::custom(format!("not UTF-8: {e}")))
}

/// Encode an error response; `id` is `null` when none could be read.
pub fn encode_error(id: Option<u64>, err: &ErrorBody) -> String {
    serde_json::json!({ "id": id, "error": err }).to_string()
}

/// Encode a request frame (used by clients).
pub fn encode_request(id: u64, op: &str, args: &Value) -> String {
    // A `Value` always serializes.
    encode_request_typed(id, op, args).expect("a JSON value serializes")
}

/// Encode a request frame from typed arguments, without building a `Value` first.
pub fn encode_request_typed<A: Serialize + ?Sized>(
    id: u64,
    op: &str,
    args: &A,
) -> Result<String, serde_json::Error> {
    #[derive(Serialize)]
    struct RequestFrame<'a, A: ?Sized> {
        id: u64,
        op: &'a str,
        args: &'a A,
    }
    to_json_text(&RequestFrame { id, op, args }, FRAME_CAPACITY)
}

/// Bytes reserved for a frame before it is written (most frames are smaller).
pub const FRAME_CAPACITY: usize = 512;

/// A server push, tagged by its `push` member (`J`: the form of an invoke's input and
/// of an event's detail, see [`crate::Turn`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "push", rename_all = "snake_case")]
#[serde(bound(deserialize = "J: Deserialize<'de> + Default"))]
pub enum Push<J = Value> {
    Invoke(crate::objects::Invoke<J>),
    Cancel {
        invocation_id: String,
        reason: String,
    },
    Probe {
        invocation_id: String,
    },
    Event {
        watch_id: String,
        event: crate::objects::Event<J>,
    },
    /// A live invocation's progress, to a watch that asked for it.
    Progress(ProgressPush),
    /// Progress frames a slow watch lost, sent before its next frame.
    ProgressDropped {
        watch_id: String,
        turn_id: String,
        invocation_id: String,
        count: u64,
    },
}

/// The `progress` push.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressPush {
    pub watch_id: String,
    pub turn_id: String,
    pub invocation_id: String,
    pub step: u32,
    pub attempt: u32,
    pub seq: u64,
    pub data: Value,
}

/// Any frame a server sends, as a client sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum ServerFrame {
    Ok { id: u64, ok: Value },
    Error { id: Option<u64>, error: ErrorBody },
    Push(Push),
}

/// Any frame a server sends, with the answer of an `ok` frame still JSON text borrowed
/// from the frame: a client decodes it straight into the op's typed answer.
#[derive(Debug, Clone)]
pub enum RawServerFrame<'a> {
    Ok { id: u64, ok: &'a RawValue },
    Error { id: Option<u64>, error: ErrorBody },
    Push(Push),
}

/// Decode a frame received from the server, leaving an `ok` answer as JSON text.
pub fn decode_raw_server_frame(text: &str) -> Result<RawServerFrame<'_>, String> {
    let [id, ok, error, push] = members(text, &["id", "ok", "error", "push"], false)?;
    if push.is_some() {
        let push: Push = serde_json::from_str(text).map_err(|e| format!("bad push frame: {e}"))?;
        return Ok(RawServerFrame::Push(push));
    }
    let id = id.and_then(|raw| serde_json::from_str::<u64>(raw.get()).ok());
    if let Some(err) = error {
        let error: ErrorBody =
            serde_json::from_str(err.get()).map_err(|e| format!("bad error body: {e}"))?;
        return Ok(RawServerFrame::Error { id, error });
    }
    match (id, ok) {
        (Some(id), Some(ok)) => Ok(RawServerFrame::Ok { id, ok }),
        _ => Err("frame is neither a push nor a response".into()),
    }
}

/// Decode a frame received from the server.
pub fn decode_server_frame(text: &str) -> Result<ServerFrame, String> {
    Ok(match decode_raw_server_frame(text)? {
        RawServerFrame::Ok { id, ok } => ServerFrame::Ok {
            id,
            ok: serde_json::from_str(ok.get()).map_err(|e| format!("bad ok answer: {e}"))?,
        },
        RawServerFrame::Error { id, error } => ServerFrame::Error { id, error },
        RawServerFrame::Push(p) => ServerFrame::Push(p),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_requests_and_names_bad_frames() {
        let r = decode_request(r#"{"id":3,"op":"ping"}"#).expect("valid");
        assert_eq!(r.id, 3);
        assert_eq!(r.op, "ping");
        assert_eq!(r.args, serde_json::json!({}));

        assert_eq!(decode_request("[1]").unwrap_err().id, None);
        assert_eq!(decode_request("{").unwrap_err().id, None);
        assert_eq!(
            decode_request(r#"{"id":-1,"op":"x"}"#).unwrap_err().id,
            None
        );
        assert_eq!(
            decode_request(r#"{"id":1.5,"op":"x"}"#).unwrap_err().id,
            None
        );
        assert_eq!(decode_request(r#"{"id":4}"#).unwrap_err().id, Some(4));
        assert_eq!(
            decode_request(r#"{"id":4,"op":"x","args":[]}"#)
                .unwrap_err()
                .id,
            Some(4)
        );
    }

    #[test]
    fn raw_requests_keep_args_as_text_and_refuse_ambiguity() {
        let r = decode_raw_request(r#"{"args": {"b": [1, 2]}, "op": "turn.get", "id": 2}"#)
            .expect("valid");
        assert_eq!(
            (r.id, &*r.op, r.args_text()),
            (2, "turn.get", r#"{"b": [1, 2]}"#)
        );
        let r = decode_raw_request(r#"{"id":1,"op":"p\u0069ng","args":null}"#).expect("valid");
        assert_eq!((&*r.op, r.args_text()), ("ping", "{}"));
        for (text, id, says) in [
            (
                r#"{"id":1,"id":2,"op":"ping"}"#,
                None,
                "duplicate member `id`",
            ),
            (
                r#"{"id":1,"op":"ping","args":{},"args":{}}"#,
                None,
                "duplicate member `args`",
            ),
            (r#"{"id":1,"op":"ping"} {}"#, None, "not valid JSON"),
            // What a parse into `Value` refuses is refused wherever it is: in a skipped
            // member, in `args`, in `op`.
            (
                r#"{"id":1,"op":"ping","x":"\ud800"}"#,
                None,
                "not valid JSON",
            ),
            (r#"{"id":1,"op":"ping","x":1e999}"#, None, "not valid JSON"),
            (
                r#"{"id":1,"op":"ping","args":{"y":[1e999]}}"#,
                None,
                "not valid JSON",
            ),
            (r#"{"id":1,"op":"p\ud800"}"#, None, "not valid JSON"),
            ("[1,", None, "not valid JSON"),
            (r#"{"id":1,"op":"ping""#, None, "not valid JSON"),
            ("17", None, "not a JSON object"),
            (r#"{"id":3,"op":["ping"]}"#, Some(3), "no string `op`"),
            (
                r#"{"id":3,"op":"ping","args":"x"}"#,
                Some(3),
                "must be a JSON object",
            ),
        ] {
            let e = decode_raw_request(text).expect_err(text);
            assert_eq!(e.id, id, "{text}");
            assert!(e.message.contains(says), "{text}: {}", e.message);
        }
    }

    #[test]
    fn raw_server_frames_keep_the_answer_as_text() {
        match decode_raw_server_frame(r#"{"ok": {"x": [1, "y"]}, "id": 4}"#) {
            Ok(RawServerFrame::Ok { id: 4, ok }) => assert_eq!(ok.get(), r#"{"x": [1, "y"]}"#),
            other => panic!("{other:?}"),
        }
        assert!(decode_raw_server_frame(r#"{"id": 4}"#).is_err());
        assert!(decode_raw_server_frame(r#"{"id": 4, "ok": 1, "ok": 2}"#).is_err());
        let typed = encode_request_typed(3, "turn.get", &TurnIdArgsForTest { turn_id: "t_1" })
            .expect("encodes");
        let back = decode_request(&typed).expect("decodes");
        assert_eq!(back.args, serde_json::json!({"turn_id": "t_1"}));
        assert_eq!(typed, encode_request(3, "turn.get", &back.args));
    }

    #[derive(Serialize)]
    struct TurnIdArgsForTest {
        turn_id: &'static str,
    }

    #[test]
    fn retryable_codes_match_the_table() {
        let retryable: Vec<_> = [
            ErrorCode::BadFrame,
            ErrorCode::BadRequest,
            ErrorCode::UnknownOp,
            ErrorCode::UnsupportedProtocol,
            ErrorCode::NotAuthenticated,
            ErrorCode::Forbidden,
            ErrorCode::NotFound,
            ErrorCode::Conflict,
            ErrorCode::Busy,
            ErrorCode::TooLarge,
            ErrorCode::RateLimited,
            ErrorCode::Unavailable,
            ErrorCode::ShuttingDown,
            ErrorCode::Internal,
        ]
        .into_iter()
        .filter(|c| c.retryable())
        .map(|c| c.as_str())
        .collect();
        assert_eq!(
            retryable,
            ["rate_limited", "unavailable", "shutting_down", "internal"]
        );
        let s = serde_json::to_string(&ErrorCode::UnsupportedProtocol).expect("serialize");
        assert_eq!(s, "\"unsupported_protocol\"");
    }

    #[test]
    fn numbers_survive_decode_encode_decode() {
        // Without serde_json's float_roundtrip the parse of this number is one ULP
        // off, and a resubmit of the value as the daemon prints it is a `conflict`.
        let text = r#"{"id":1,"op":"turn.submit","args":{"input":118446744073709551615}}"#;
        let r = decode_request(text).expect("valid");
        let again = decode_request(&encode_request(r.id, &r.op, &r.args)).expect("valid");
        assert_eq!(
            r.args["input"].as_f64().map(f64::to_bits),
            again.args["input"].as_f64().map(f64::to_bits)
        );
        assert_eq!(r, again);
    }

    #[test]
    fn ok_frames_carry_their_id_and_answer_exactly() {
        for id in [0, 7, 10, 12_345, u64::MAX] {
            let answer =
                to_json_text(&serde_json::json!({"turn_id": "t", "n": [1, 2]}), 4).expect("encode");
            let text = encode_ok_text(id, &answer);
            assert_eq!(text, format!("{{\"id\":{id},\"ok\":{answer}}}"));
            let f = decode_server_frame(&text).expect("ok frame");
            assert_eq!(
                f,
                ServerFrame::Ok {
                    id,
                    ok: serde_json::json!({"turn_id": "t", "n": [1, 2]})
                }
            );
        }
    }

    #[test]
    fn server_frames_round_trip() {
        let f = decode_server_frame(r#"{"id":1,"ok":{}}"#).expect("ok frame");
        assert!(matches!(f, ServerFrame::Ok { id: 1, .. }));
        let f = decode_server_frame(
            r#"{"id":null,"error":{"code":"bad_frame","message":"x","retryable":false}}"#,
        )
        .expect("error frame");
        assert!(matches!(f, ServerFrame::Error { id: None, .. }));
        let f = decode_server_frame(r#"{"push":"probe","invocation_id":"inv_1"}"#).expect("push");
        assert_eq!(
            f,
            ServerFrame::Push(Push::Probe {
                invocation_id: "inv_1".into()
            })
        );
        let ok = serde_json::json!({"turn": {"seq": 3, "output": [1.5, "x", null]}});
        let text = encode_ok(7, &ok);
        assert_eq!(
            decode_server_frame(&text).expect("encoded ok frame"),
            ServerFrame::Ok {
                id: 7,
                ok: ok.clone()
            }
        );
        let raw = serde_json::value::to_raw_value(&ok).expect("raw");
        assert_eq!(encode_ok_raw(7, &raw), text);
    }
}
