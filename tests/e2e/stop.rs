//! Stop always terminalizes (semantics: Stop).
